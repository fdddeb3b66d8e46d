// C++ tests of the CUDA backend (zerocore/cuda_backend.h), without torch.
//   test_cuda_backend args  what is checked before any CUDA call (a stream
//                           or event of another backend, a tensor on another
//                           device, a kernel over host and device memory at
//                           once, each error naming the op and the tensors)
//                           and, without a device, that the first CUDA call
//                           raises naming that call: runs on machines
//                           without a GPU or driver;
//   test_cuda_backend gpu   every op against the CpuBackend on the same
//                           fresh random inputs: copies between all memory
//                           kinds, fill, accumulate and the Adam/SGD updates
//                           bit for bit; the sum of squares against a long
//                           double sum to float64 rounding, and its finiteness
//                           flag with a NaN and an inf; events ordering work
//                           across a compute, a comm and a copy stream; a
//                           change of compute stream waiting for the old
//                           one; poison writing NaN only when asked to; a
//                           collective's pending event; an injected CUDA
//                           failure raising with the call named; the pageable
//                           fallback when pinning fails (one warning); the
//                           live bytes counted by kind. Exits
//                           77 (ctest: skipped) without a device.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "zerocore/backend/cpu_backend.h"
#include "zerocore/backend/mailbox.h"
#include "zerocore/cuda_backend.h"
#include "zerocore/cuda_optim.h"
#include "zerocore/error.h"
#include "zerocore/half.h"
#include "test_modes.h"
#include "zerocore/runtime/event.h"

using namespace zerocore;

namespace {

using cuda_tests::failures;
using cuda_tests::has;
using cuda_tests::message_of;

// A tensor claiming to be on `device` whose memory is never touched: enough
// for checks that read only dtype, device and size.
Tensor fake(int64_t n, DType dtype, Device device) {
  static char dummy[64];
  return Tensor(dummy, dtype, device, {n}, std::shared_ptr<void>(dummy, [](void*) {}));
}

void test_args() {
  CHECK(has(message_of<InvalidArgument>([] { CudaBackend(-1); }), "device index -1"));
  CudaBackend gpu(0);  // touches no CUDA
  gpu.set_compute_stream(nullptr);  // the stream it has: nothing to order, no CUDA touched
  CpuBackend cpu;
  Stream& s = gpu.compute_stream();
  const Device cuda0{DeviceType::kCUDA, 0}, cuda1{DeviceType::kCUDA, 1};
  const Tensor host = fake(8, DType::kFloat32, Device{}), dev = fake(8, DType::kFloat32, cuda0);
  const Tensor other = fake(8, DType::kFloat32, cuda1);

  // Streams and events of another backend.
  CHECK(has(message_of<InvalidArgument>([&] { gpu.fill(cpu.compute_stream(), dev, 1.0f); }), "another backend"));
  CHECK(has(message_of<InvalidArgument>([&] { gpu.host_wait(*cpu.record(cpu.compute_stream())); }),
            "another backend"));
  CHECK(has(message_of<InvalidArgument>([&] { gpu.record_done(s, nullptr); }), "record_done"));

  // Tensors on another device, or a kernel over host and device memory at
  // once (over host memory alone it runs on the host), named with the op.
  CHECK(has(message_of<InvalidArgument>([&] { gpu.accumulate(s, dev, host); }),
            "accumulate: src is host memory and dst device memory"));
  CHECK(has(message_of<InvalidArgument>([&] { gpu.accumulate(s, dev, other); }), "accumulate: src is on cuda:1"));
  CHECK(has(message_of<InvalidArgument>([&] { gpu.copy(s, other, dev); }), "copy: dst is on cuda:1"));
  CHECK(has(message_of<InvalidArgument>([&] { gpu.poison(s, other); }), "poison: range is on cuda:1"));
  CHECK(has(message_of<InvalidArgument>([&] { gpu.copy(s, dev, fake(8, DType::kBFloat16, cuda0)); }),
            "does not convert"));
  Mailbox box(cpu, 2, "norm");
  CHECK(has(message_of<InvalidArgument>([&] { gpu.sum_of_squares(s, {dev, host}, box, 0, 1); }),
            "sum_of_squares: xs[1] is host memory and xs[0] device memory"));
  const FlatRun run{0, dev, host, dev, dev, Tensor()};
  CHECK(has(message_of<InvalidArgument>([&] { gpu.adam_update_runs(s, {AdamOptions{}}, 1, 1.0, {run}, Tensor()); }),
            "adam_update_runs: run 0's grad is host memory and run 0's param device memory"));
  const FlatRun copy_elsewhere{0, dev, dev, dev, Tensor(), other};
  CHECK(has(message_of<InvalidArgument>([&] { gpu.sgd_update_runs(s, {SgdOptions{}}, 1, 1.0, {copy_elsewhere}, Tensor()); }),
            "sgd_update_runs: run 0's param_copy is on cuda:1"));

  if (cuda_device_count() == 0) {
    // The first CUDA call fails, and says which it was.
    const std::string m = message_of<std::exception>([&] { gpu.allocate(MemoryKind::kDevice, 64, "x"); });
    CHECK(has(m, "zerocore: cuda") && has(m, " failed: cuda"));
  }
}

void cuda_ok(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

// n elements of `dtype` in a buffer of `kind`, starting `offset` elements
// in (offset 1 defeats the kernels' packed access).
Tensor make(Backend& b, MemoryKind kind, int64_t n, DType dtype, int64_t offset = 0, bool zeroed = false) {
  const size_t size = dtype_size(dtype);
  auto buffer = b.allocate(kind, size_t(n + offset) * size, "test", zeroed);
  return buffer->view(size_t(offset) * size, dtype, {n});
}

void randomize(const Tensor& t, std::mt19937& rng, float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float x = dist(rng);
    if (t.dtype() == DType::kFloat32) t.data_as<float>()[i] = x;
    if (t.dtype() == DType::kBFloat16) t.data_as<uint16_t>()[i] = float_to_bf16(x);
    if (t.dtype() == DType::kFloat16) t.data_as<uint16_t>()[i] = float_to_fp16(x);
  }
}

void finish(CudaBackend& g, Stream& s) { g.host_wait(*g.record(s)); }

// A device tensor holding `host`'s bytes, `offset` elements into its buffer.
Tensor on_device(CudaBackend& g, const Tensor& host, int64_t offset = 0) {
  Tensor d = make(g, MemoryKind::kDevice, host.numel(), host.dtype(), offset);
  g.copy(g.compute_stream(), d, host);
  finish(g, g.compute_stream());
  return d;
}

bool same_bits(CudaBackend& g, const Tensor& expected_host, const Tensor& actual) {
  Tensor back = make(g, MemoryKind::kHostPageable, actual.numel(), actual.dtype());
  g.copy(g.compute_stream(), back, actual);
  finish(g, g.compute_stream());
  return std::memcmp(back.data(), expected_host.data(), expected_host.nbytes()) == 0;
}

// A host copy from the CPU backend (the reference's inputs).
Tensor host_copy(CpuBackend& cpu, const Tensor& t) {
  Tensor h = make(cpu, MemoryKind::kHostPageable, t.numel(), t.dtype());
  std::memcpy(h.data(), t.data(), t.nbytes());
  return h;
}

const MemoryKind kKinds[] = {MemoryKind::kHostPageable, MemoryKind::kHostPinned, MemoryKind::kDevice};
const DType kDtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

void test_copies(CudaBackend& g, std::mt19937& rng) {
  Stream& copies = g.create_stream("copy");
  for (MemoryKind from : kKinds) {
    for (MemoryKind to : kKinds) {
      const int64_t n = 100003;
      Tensor expected = make(g, MemoryKind::kHostPageable, n, DType::kBFloat16);
      randomize(expected, rng);
      Tensor src = make(g, from, n, DType::kBFloat16), dst = make(g, to, n, DType::kBFloat16);
      g.copy(g.compute_stream(), src, expected);
      g.wait(copies, *g.record(g.compute_stream()));
      g.copy(copies, dst, src);
      finish(g, copies);
      if (!same_bits(g, expected, dst)) {
        std::fprintf(stderr, "copy mismatch: %s to %s\n", memory_kind_name(from), memory_kind_name(to));
        ++failures;
      }
    }
  }
}

void test_fill_accumulate(CudaBackend& g, CpuBackend& cpu, std::mt19937& rng) {
  const int64_t n = 300007;
  for (DType d : kDtypes) {
    for (int64_t offset : {0, 1}) {
      const float value = std::normal_distribution<float>()(rng);
      Tensor host = make(cpu, MemoryKind::kHostPageable, n, d);
      Tensor dev = make(g, MemoryKind::kDevice, n, d, offset);
      cpu.fill(cpu.compute_stream(), host, value);
      g.fill(g.compute_stream(), dev, value);
      CHECK(same_bits(g, host, dev));
      for (DType s : kDtypes) {
        Tensor dst = make(cpu, MemoryKind::kHostPageable, n, d), src = make(cpu, MemoryKind::kHostPageable, n, s);
        randomize(dst, rng);
        randomize(src, rng);
        Tensor ddst = on_device(g, dst, offset), dsrc = on_device(g, src, offset);
        cpu.accumulate(cpu.compute_stream(), dst, src);
        g.accumulate(g.compute_stream(), ddst, dsrc);
        if (!same_bits(g, dst, ddst)) {
          std::fprintf(stderr, "accumulate mismatch: dst=%s src=%s offset=%lld\n", dtype_name(d), dtype_name(s),
                       (long long)offset);
          ++failures;
        }
      }
    }
  }
}

long double exact_sum_of_squares(const std::vector<Tensor>& hosts) {
  long double sum = 0.0L;
  for (const Tensor& t : hosts) {
    for (int64_t i = 0; i < t.numel(); ++i) {
      float x = 0.0f;
      if (t.dtype() == DType::kFloat32) x = t.data_as<float>()[i];
      if (t.dtype() == DType::kBFloat16) x = bf16_to_float(t.data_as<uint16_t>()[i]);
      if (t.dtype() == DType::kFloat16) x = fp16_to_float(t.data_as<uint16_t>()[i]);
      sum += (long double)x * x;
    }
  }
  return sum;
}

void test_sum_of_squares(CudaBackend& g, CpuBackend& cpu, std::mt19937& rng) {
  // Mixed dtypes, an empty tensor, one of many chunks, odd lengths.
  std::vector<Tensor> hosts, devs;
  const int64_t lengths[] = {1, 0, 4099, 2000003, 77};
  int64_t total = 0;
  for (int k = 0; k < 5; ++k) {
    Tensor h = make(cpu, MemoryKind::kHostPageable, lengths[k], kDtypes[k % 3]);
    randomize(h, rng, k == 3 ? 1e-3f : 3.0f);
    hosts.push_back(h);
    devs.push_back(on_device(g, h, k % 2));
    total += lengths[k];
  }
  Mailbox box(g, 3, "norm"), cpu_box(cpu, 3, "norm");
  g.sum_of_squares(g.compute_stream(), devs, box, 2, 0);
  cpu.sum_of_squares(cpu.compute_stream(), hosts, cpu_box, 2, 0);
  finish(g, g.compute_stream());
  const long double exact = exact_sum_of_squares(hosts);
  // Every square is exact in float64; each of at most `total` additions of
  // non-negative terms rounds by at most 2^-53 of the running sum.
  const long double bound = exact * (long double)total * std::ldexp(1.0L, -52);
  CHECK(std::fabs((long double)box.read(2) - exact) <= bound);
  CHECK(std::fabs((long double)cpu_box.read(2) - exact) <= bound);
  CHECK(box.read(0) == 1.0);
  // The same bits on a second call on the same device.
  const double first = box.read(2);
  g.sum_of_squares(g.compute_stream(), devs, box, 2, 0);
  finish(g, g.compute_stream());
  CHECK(box.read(2) == first);
  // Nothing to add: 0 and finite.
  g.sum_of_squares(g.compute_stream(), {}, box, 1, 0);
  finish(g, g.compute_stream());
  CHECK(box.read(1) == 0.0 && box.read(0) == 1.0);
  // One NaN, or one inf, anywhere makes the flag 0.
  for (float bad : {std::nanf(""), INFINITY}) {
    Tensor h = host_copy(cpu, hosts[3]);
    h.data_as<float>()[1234567] = bad;
    std::vector<Tensor> with_bad = devs;
    with_bad[3] = on_device(g, h);
    g.sum_of_squares(g.compute_stream(), with_bad, box, 2, 0);
    finish(g, g.compute_stream());
    CHECK(box.read(0) == 0.0);
  }
}

void test_updates(CudaBackend& g, CpuBackend& cpu, std::mt19937& rng, bool sgd) {
  std::vector<FlatRun> host_runs, dev_runs;
  const int64_t lengths[] = {5, 70001, 3};
  for (int k = 0; k < 3; ++k) {
    const int64_t n = lengths[k];
    FlatRun h{k % 2,
              make(cpu, MemoryKind::kHostPageable, n, DType::kFloat32),
              make(cpu, MemoryKind::kHostPageable, n, kDtypes[k]),
              make(cpu, MemoryKind::kHostPageable, n, DType::kFloat32),
              sgd ? Tensor() : make(cpu, MemoryKind::kHostPageable, n, DType::kFloat32, 0, true),
              make(cpu, MemoryKind::kHostPageable, n, DType::kBFloat16)};
    randomize(h.param, rng);
    randomize(h.state0, rng, 0.1f);
    host_runs.push_back(h);
    dev_runs.push_back(FlatRun{h.param_group, on_device(g, h.param, k % 2), on_device(g, h.grad, k % 2),
                               on_device(g, h.state0, k % 2), sgd ? Tensor() : on_device(g, h.state1, k % 2),
                               on_device(g, h.param_copy, k % 2)});
  }
  for (int64_t step = 1; step <= 3; ++step) {
    for (size_t k = 0; k < host_runs.size(); ++k) {
      randomize(host_runs[k].grad, rng);
      g.copy(g.compute_stream(), dev_runs[k].grad, host_runs[k].grad);
    }
    if (sgd) {
      SgdOptions a, b;
      a.momentum = 0.9;
      a.weight_decay = 0.1;
      b.momentum = 0.8;
      b.nesterov = true;
      cpu.sgd_update_runs(cpu.compute_stream(), {a, b}, step, 0.5, host_runs, Tensor());
      g.sgd_update_runs(g.compute_stream(), {a, b}, step, 0.5, dev_runs, Tensor());
    } else {
      AdamOptions a, b;
      a.weight_decay = 0.1;
      b.adamw = false;
      b.lr = 3e-3;
      cpu.adam_update_runs(cpu.compute_stream(), {a, b}, step, 0.5, host_runs, Tensor());
      g.adam_update_runs(g.compute_stream(), {a, b}, step, 0.5, dev_runs, Tensor());
    }
  }
  for (size_t k = 0; k < host_runs.size(); ++k) {
    const FlatRun &h = host_runs[k], &d = dev_runs[k];
    const bool ok = same_bits(g, h.param, d.param) && same_bits(g, h.state0, d.state0) &&
                    (sgd || same_bits(g, h.state1, d.state1)) && same_bits(g, h.param_copy, d.param_copy);
    if (!ok) {
      std::fprintf(stderr, "%s mismatch in run %zu\n", sgd ? "sgd" : "adam", k);
      ++failures;
    }
  }
}

// compute fills x, comm adds x into y (as a reduction would), copy brings y
// to pinned host memory, the host reads it: each step waits for the one
// before through an event, on three streams (the compute one the caller's).
// The buffers are large, so a missing wait would read unfinished work.
void test_event_ordering(CudaBackend& g) {
  cudaStream_t caller = nullptr;
  cuda_ok(cudaStreamCreate(&caller), "cudaStreamCreate");
  g.set_compute_stream(caller);
  CHECK(g.handle(g.compute_stream()) == caller);
  Stream& comm = g.create_stream("comm");
  Stream& copies = g.create_stream("copy");
  const int64_t n = 1 << 24;
  Tensor x = make(g, MemoryKind::kDevice, n, DType::kFloat32), y = make(g, MemoryKind::kDevice, n, DType::kFloat32, 0, true);
  Tensor out = make(g, MemoryKind::kHostPinned, n, DType::kFloat32);
  for (int round = 1; round <= 5; ++round) {
    g.fill(g.compute_stream(), x, float(round));
    g.wait(comm, *g.record(g.compute_stream()));
    g.accumulate(comm, y, x);
    g.wait(copies, *g.record(comm));
    g.copy(copies, out, y);
    auto done = g.record(copies);
    g.host_wait(*done);
    CHECK(g.query(*done));
    const float expected = float(round * (round + 1) / 2);
    bool ok = true;
    for (int64_t i = 0; i < n; i += 4097) ok = ok && out.data_as<float>()[i] == expected;
    ok = ok && out.data_as<float>()[n - 1] == expected;
    CHECK(ok);
    // The next fill must not overtake this round's accumulate.
    g.wait(g.compute_stream(), *g.record(comm));
  }
  // A collective's event, pending until the issuing thread sets `done`; the
  // comm stream's work is ordered before it once it is.
  auto flag = std::make_shared<Event>();
  g.fill(comm, y, 7.0f);
  auto collective = g.record_done(comm, flag);
  CHECK(!g.query(*collective));
  std::thread issuer([&] {  // a native thread driving the backend
    g.fill(comm, x, 9.0f);
    flag->set();
  });
  g.wait(copies, *collective);  // blocks the host until `done` is set
  issuer.join();
  g.copy(copies, out.slice(0, 1), x.slice(n - 1, 1));
  g.host_wait(*g.record(copies));
  CHECK(out.data_as<float>()[0] == 9.0f);
  CHECK(g.query(*collective));
  // An error carried by `done` is raised where the event is waited for.
  auto failed = std::make_shared<Event>();
  failed->set(std::make_exception_ptr(std::runtime_error("collective failed on a peer")));
  CHECK(has(message_of<std::runtime_error>([&] { g.host_wait(*g.record_done(comm, failed)); }), "on a peer"));
  g.set_compute_stream(nullptr);
  cuda_ok(cudaStreamDestroy(caller), "cudaStreamDestroy");
}

// A change of compute stream keeps the compute stream's order: the new
// stream waits for what the old one was given. The old stream is held by a
// host function until the host lets it go, so what the check sees does not
// depend on timing: without the wait, the copy on the new stream would be
// done long before.
void test_compute_stream_switch(CudaBackend& g) {
  cudaStream_t first = nullptr, second = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&first, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  cuda_ok(cudaStreamCreateWithFlags(&second, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  g.set_compute_stream(first);
  const int64_t n = 1 << 20;
  Tensor x = make(g, MemoryKind::kDevice, n, DType::kFloat32, 0, true);
  Tensor y = make(g, MemoryKind::kDevice, n, DType::kFloat32, 0, true);
  std::atomic<bool> go{false};
  cuda_ok(cudaLaunchHostFunc(
              first,
              [](void* flag) {
                while (!static_cast<std::atomic<bool>*>(flag)->load()) std::this_thread::yield();
              },
              &go),
          "cudaLaunchHostFunc");
  g.fill(g.compute_stream(), x, 3.0f);  // on the first stream, behind the held host function
  g.set_compute_stream(second);
  CHECK(g.handle(g.compute_stream()) == second);
  g.copy(g.compute_stream(), y, x);  // on the second: after the fill through the switch alone
  auto copied = g.record(g.compute_stream());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK(!g.query(*copied));
  go = true;
  g.host_wait(*copied);
  Tensor threes = make(g, MemoryKind::kHostPageable, n, DType::kFloat32);
  for (int64_t i = 0; i < n; ++i) threes.data_as<float>()[i] = 3.0f;
  CHECK(same_bits(g, threes, y));
  g.set_compute_stream(nullptr);
  cuda_ok(cudaStreamDestroy(first), "cudaStreamDestroy");
  cuda_ok(cudaStreamDestroy(second), "cudaStreamDestroy");
}

// Poisoning is a debug option: by default a released range keeps its
// bytes; with poison_released it reads as NaN, on every memory kind.
void test_poison() {
  CudaBackendOptions on;
  on.poison_released = true;
  CudaBackend quiet(0), poisoning(0, nullptr, on);
  for (CudaBackend* g : {&quiet, &poisoning}) {
    for (MemoryKind kind : kKinds) {
      Tensor t = make(*g, kind, 1001, DType::kBFloat16, 0, true);
      g->poison(g->compute_stream(), t.slice(10, 990));
      Tensor back = make(*g, MemoryKind::kHostPageable, 1001, DType::kBFloat16);
      g->copy(g->compute_stream(), back, t);
      finish(*g, g->compute_stream());
      bool ok = true;
      for (int64_t i = 0; i < 1001; ++i) {
        const float value = bf16_to_float(back.data_as<uint16_t>()[i]);
        ok = ok && (g == &poisoning && i >= 10 && i < 1000 ? std::isnan(value) : value == 0.0f);
      }
      if (!ok) {
        std::fprintf(stderr, "poison wrong on %s memory (poison_released=%d)\n", memory_kind_name(kind),
                     int(g == &poisoning));
        ++failures;
      }
    }
  }
}

void test_injected_failure(CudaBackend& g) {
  const std::string m = message_of<std::exception>(
      [&] { g.allocate(MemoryKind::kDevice, size_t(1) << 60, "far too big"); });
  CHECK(has(m, "cudaMalloc(") && has(m, "far too big") && has(m, "cudaErrorMemoryAllocation"));
  // Not sticky: the backend goes on working.
  const Tensor zeros = make(g, MemoryKind::kHostPageable, 16, DType::kFloat32, 0, true);
  CHECK(same_bits(g, zeros, make(g, MemoryKind::kDevice, 16, DType::kFloat32, 0, true)));
}

int refuse_to_pin(void**, size_t) { return int(cudaErrorMemoryAllocation); }

// Pinning fails: buffers are pageable (and say so), one warning for the
// process, and copies and the mailbox still work.
void test_pageable_fallback(std::mt19937& rng) {
  CudaBackendOptions options;
  options.pin_host = refuse_to_pin;
  CudaBackend g(0, nullptr, options);
  std::fflush(stderr);
  const int saved = dup(2);
  std::FILE* captured = std::tmpfile();
  dup2(fileno(captured), 2);
  auto a = g.allocate(MemoryKind::kHostPinned, 4096, "staging", true);
  auto b = g.allocate(MemoryKind::kHostPinned, 4096, "staging 2");
  Mailbox box(g, 2, "norm");
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  std::string text(4096, '\0');
  std::rewind(captured);
  text.resize(std::fread(&text[0], 1, text.size(), captured));
  std::fclose(captured);
  CHECK(has(text, "could not pin 4096 bytes of host memory for 'staging'"));
  CHECK(text.find("warning", text.find("warning") + 1) == std::string::npos);  // once
  CHECK(a->kind() == MemoryKind::kHostPageable && b->kind() == MemoryKind::kHostPageable);
  CHECK(g.allocated_bytes(MemoryKind::kHostPinned) == 0 &&
        g.allocated_bytes(MemoryKind::kHostPageable) == a->bytes() + b->bytes() + box.buffer()->bytes());
  CHECK(static_cast<const char*>(a->data())[4095] == 0);

  Tensor host = a->view(0, DType::kFloat32, {1024});
  randomize(host, rng);
  Tensor dev = on_device(g, host);
  Tensor back = b->view(0, DType::kFloat32, {1024});
  g.copy(g.compute_stream(), back, dev);
  g.sum_of_squares(g.compute_stream(), {dev}, box, 0, 1);
  finish(g, g.compute_stream());
  CHECK(std::memcmp(back.data(), host.data(), host.nbytes()) == 0);
  const long double exact = exact_sum_of_squares({host});
  CHECK(std::fabs((long double)box.read(0) - exact) <= exact * 1024 * std::ldexp(1.0L, -52));
  CHECK(box.read(1) == 1.0);
}

// The step's device verdict: count_nonfinite adds 1 to a device counter
// only for tensors holding an inf or NaN (any dtype), and an update given
// skip_if leaves everything alone while it is not zero and updates as the
// CPU kernel does once it is zero again.
void test_device_verdict(CudaBackend& g, CpuBackend& cpu, std::mt19937& rng) {
  Stream& s = g.compute_stream();
  const Tensor zero = make(cpu, MemoryKind::kHostPageable, 1, DType::kFloat32, 0, true);
  const Tensor counter = on_device(g, zero);
  std::vector<Tensor> finite;
  for (DType dtype : kDtypes) {
    Tensor h = make(cpu, MemoryKind::kHostPageable, 5000, dtype);
    randomize(h, rng);
    finite.push_back(on_device(g, h));
  }
  g.count_nonfinite(s, finite, counter);
  CHECK(same_bits(g, zero, counter));
  Tensor bad = make(cpu, MemoryKind::kHostPageable, 5000, DType::kBFloat16);
  randomize(bad, rng);
  bad.data_as<uint16_t>()[4321] = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  g.count_nonfinite(s, {finite[0], on_device(g, bad)}, counter);
  const Tensor one = make(cpu, MemoryKind::kHostPageable, 1, DType::kFloat32, 0, true);
  one.data_as<float>()[0] = 1.0f;
  CHECK(same_bits(g, one, counter));

  Tensor param = make(cpu, MemoryKind::kHostPageable, 3000, DType::kFloat32);
  Tensor grad = make(cpu, MemoryKind::kHostPageable, 3000, DType::kFloat32);
  randomize(param, rng);
  randomize(grad, rng);
  Tensor m = make(cpu, MemoryKind::kHostPageable, 3000, DType::kFloat32, 0, true);
  Tensor v = make(cpu, MemoryKind::kHostPageable, 3000, DType::kFloat32, 0, true);
  const FlatRun dev{0, on_device(g, param), on_device(g, grad), on_device(g, m), on_device(g, v), Tensor()};
  g.adam_update_runs(s, {AdamOptions{}}, 1, 1.0, {dev}, counter);  // refused: nothing moves
  CHECK(same_bits(g, param, dev.param) && same_bits(g, m, dev.state0));
  g.copy(s, counter, zero);
  g.adam_update_runs(s, {AdamOptions{}}, 1, 1.0, {dev}, counter);
  cpu.adam_update_runs(cpu.compute_stream(), {AdamOptions{}}, 1, 1.0, {FlatRun{0, param, grad, m, v, Tensor()}},
                       Tensor());
  CHECK(same_bits(g, param, dev.param) && same_bits(g, v, dev.state1));
}

// allocated_bytes counts cudaMalloc'd and pinned buffers by kind until
// they are freed.
void test_allocated_bytes() {
  CudaBackend g(0);
  auto device = g.allocate(MemoryKind::kDevice, 4096, "device", true);
  auto pinned = g.allocate(MemoryKind::kHostPinned, 1000, "pinned");
  CHECK(pinned->kind() == MemoryKind::kHostPinned);
  CHECK(g.allocated_bytes(MemoryKind::kDevice) == 4096 && g.allocated_bytes(MemoryKind::kHostPinned) == 1000 &&
        g.allocated_bytes(MemoryKind::kHostPageable) == 0);
  device.reset();
  pinned.reset();
  CHECK(g.allocated_bytes(MemoryKind::kDevice) == 0 && g.allocated_bytes(MemoryKind::kHostPinned) == 0);
}

void test_gpu() {
  std::mt19937 rng(20261124);
  CpuBackend cpu;
  CudaBackend g(0);
  test_copies(g, rng);
  test_fill_accumulate(g, cpu, rng);
  test_sum_of_squares(g, cpu, rng);
  test_device_verdict(g, cpu, rng);
  test_updates(g, cpu, rng, false);
  test_updates(g, cpu, rng, true);
  test_event_ordering(g);
  test_compute_stream_switch(g);
  test_poison();
  test_injected_failure(g);
  test_pageable_fallback(rng);
  test_allocated_bytes();
}

}  // namespace

int main(int argc, char** argv) { return cuda_tests::run_mode(argc, argv, test_args, test_gpu); }
