// cpu_adam_bench: the CPU Adam update against the memory bandwidth this
// machine delivers in the same run, with the same threads and arenas.
//
//   cpu_adam_bench [--params N] [--threads T] [--iters K] [--isa scalar|avx2|avx512] [--stream-only]
//
// Measures (best and median of K timed iterations after one warm-up):
//   stream triad          a = b + s*c, 12 B/param, the classic reference;
//   stream offload        the update's access pattern (read 3 fp32 + 1 bf16,
//                         write 3 fp32 + 1 bf16), 28 B/param, trivial math;
//   adam fp32             zerocore::adam_update, fp32 grad, no copy: read
//                         p, g, m, v and write p, m, v, 28 B/param;
//   adam offload          bf16 grad in, bf16 param copy out, 28 B/param;
// and prints the offload update's bandwidth as a fraction of the offload
// stream's, and the CPU time other processes took meanwhile (on a shared
// machine that makes every number low). --stream-only prints just the stream
// lines (compare_cpu_adam.py runs it that way for its reference).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <unistd.h>

#include "stream_bandwidth.h"
#include "zerocore/zerocore.h"

namespace {

using namespace zerocore;

struct Options {
  int64_t params = int64_t(64) << 20;
  int threads = 0;  // 0: zerocore's default (the CPUs this process may use)
  int iters = 10;
  const char* isa = nullptr;
  bool stream_only = false;
};

[[noreturn]] void usage(const char* msg) {
  std::fprintf(stderr,
               "%s\nusage: cpu_adam_bench [--params N] [--threads T] [--iters K] "
               "[--isa scalar|avx2|avx512] [--stream-only]\n",
               msg);
  std::exit(2);
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage(("missing value for " + arg).c_str());
      return argv[++i];
    };
    if (arg == "--params") {
      o.params = std::atoll(value());
    } else if (arg == "--threads") {
      o.threads = std::atoi(value());
    } else if (arg == "--iters") {
      o.iters = std::atoi(value());
    } else if (arg == "--isa") {
      o.isa = value();
    } else if (arg == "--stream-only") {
      o.stream_only = true;
    } else if (arg == "--help" || arg == "-h") {
      usage("cpu_adam_bench: CPU Adam update vs stream bandwidth");
    } else {
      usage(("unknown argument " + arg).c_str());
    }
  }
  if (o.params < 1 || o.iters < 1 || o.threads < 0) usage("--params and --iters must be >= 1, --threads >= 0");
  return o;
}

Isa parse_isa(const std::string& name) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (name == isa_name(isa)) return isa;
  }
  usage(("unknown --isa " + name).c_str());
}

struct Timing {
  double best_s;
  double median_s;
};

// One kernel under test; `call` gets the 1-based call count (Adam's step).
struct Case {
  const char* name;
  double bytes_per_param;
  std::function<void(int)> call;
};

// One untimed warm-up call per case, then `iters` timed rounds that take
// the cases in turn, so that a change in machine load (other processes,
// the hypervisor) hits every case alike instead of the one that ran then.
// `prepare` (untimed) runs before every call so that each starts from the
// same values.
std::vector<Timing> time_interleaved(const std::vector<Case>& cases, int iters,
                                     const std::function<void()>& prepare) {
  std::vector<std::vector<double>> seconds(cases.size());
  for (const Case& c : cases) {
    prepare();
    c.call(1);
  }
  for (int k = 2; k <= iters + 1; ++k) {
    for (size_t j = 0; j < cases.size(); ++j) {
      prepare();
      const auto t0 = std::chrono::steady_clock::now();
      cases[j].call(k);
      seconds[j].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  std::vector<Timing> out;
  for (auto& s : seconds) {
    std::sort(s.begin(), s.end());
    out.push_back({s.front(), s[s.size() / 2]});
  }
  return out;
}

void print_row(const char* name, double bytes_per_param, int64_t n, const Timing& t) {
  std::printf("%-38s %9.2f %9.2f %10.3f %8.1f\n", name, t.best_s * 1e3, t.median_s * 1e3,
              double(n) / t.best_s * 1e-9, double(n) * bytes_per_param / t.best_s * 1e-9);
}

// Anonymous memory of this process backed by transparent huge pages: shows
// whether the arenas' MADV_HUGEPAGE advice took effect.
size_t anon_huge_page_bytes() {
  std::ifstream f("/proc/self/smaps_rollup");
  std::string key;
  size_t kib = 0;
  while (f >> key) {
    if (key == "AnonHugePages:") {
      f >> kib;
      return kib << 10;
    }
    f.ignore(1 << 20, '\n');
  }
  return 0;
}

// CPU seconds used by the whole machine (from /proc/stat) and by this
// process. Their difference over a measurement is what other processes
// took: on a shared machine, numbers taken while that is not ~0 understate
// what the machine can do.
struct CpuSeconds {
  double machine_busy;
  double self;
};

CpuSeconds cpu_seconds() {
  std::ifstream f("/proc/stat");
  std::string label;
  double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  f >> label >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
  const double ticks = double(sysconf(_SC_CLK_TCK));
  rusage self{};
  getrusage(RUSAGE_SELF, &self);
  return {(user + nice + system + irq + softirq + steal) / ticks,
          double(self.ru_utime.tv_sec + self.ru_stime.tv_sec) +
              1e-6 * double(self.ru_utime.tv_usec + self.ru_stime.tv_usec)};
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse_args(argc, argv);
  try {
    if (opt.isa) set_cpu_isa(parse_isa(opt.isa));
    if (opt.threads > 0) set_num_threads(opt.threads);
  } catch (const std::exception& e) {
    usage(e.what());
  }
  const int64_t n = opt.params;

  // Each array is its own HostArena (2 MiB aligned, huge pages), as the
  // optimizer partitions are in training.
  Tensor param = Tensor::empty({n}, DType::kFloat32);
  Tensor exp_avg = Tensor::empty({n}, DType::kFloat32);
  Tensor exp_avg_sq = Tensor::empty({n}, DType::kFloat32);
  Tensor grad_bf16 = Tensor::empty({n}, DType::kBFloat16);
  Tensor param_bf16 = Tensor::empty({n}, DType::kBFloat16);
  Tensor grad_fp32 = opt.stream_only ? Tensor() : Tensor::empty({n}, DType::kFloat32);

  // Fills every array from the pool's threads: the first call faults the
  // pages in (never inside a timed region), later calls reset the values.
  // Gradients stay in [0.01, 0.02] so no value drifts towards denormals.
  auto reset = [&] {
    default_thread_pool().parallel_for(n, bench::kStreamChunkAlign, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float g = 0.01f + 0.01f * float(i % 97) / 97.0f;
        param.data_as<float>()[i] = 0.5f - float(i % 89) / 89.0f;
        exp_avg.data_as<float>()[i] = 0.1f * g;
        exp_avg_sq.data_as<float>()[i] = 0.01f * g * g;
        grad_bf16.data_as<uint16_t>()[i] = float_to_bf16(g);
        param_bf16.data_as<uint16_t>()[i] = 0;
        if (grad_fp32.data()) grad_fp32.data_as<float>()[i] = g;
      }
    });
  };
  reset();

  std::printf("cpu_adam_bench: params=%lld threads=%d isa=%s iters=%d (best and median after 1 warm-up)\n",
              (long long)n, num_threads(), isa_name(active_isa()), opt.iters);
  std::printf("huge pages: %zu of %zu MiB of host arenas (AnonHugePages)\n", anon_huge_page_bytes() >> 20,
              HostArena::live_bytes() >> 20);
  std::printf("%-38s %9s %9s %10s %8s\n", "", "best ms", "median ms", "Gparam/s", "GB/s");

  const bench::OffloadArrays arrays{param.data_as<float>(),       exp_avg.data_as<float>(),
                                    exp_avg_sq.data_as<float>(),  grad_bf16.data_as<uint16_t>(),
                                    param_bf16.data_as<uint16_t>(), n};
  AdamOptions adam;
  adam.weight_decay = 0.01;
  std::vector<Case> cases = {
      {"stream triad (12 B/param)", bench::kTriadBytesPerParam,
       [&](int) { bench::stream_triad(arrays.param, arrays.exp_avg, arrays.exp_avg_sq, 0.5f, n); }},
      {"stream offload pattern (28 B/param)", bench::kOffloadBytesPerParam,
       [&](int) { bench::stream_offload(arrays, 1e-3f); }},
  };
  if (!opt.stream_only) {
    cases.push_back({"adam fp32 (28 B/param)", 28.0, [&](int step) {
                       adam_update(adam, step, 1.0, param, grad_fp32, exp_avg, exp_avg_sq, Tensor());
                     }});
    cases.push_back({"adam offload bf16->bf16 (28 B/param)", 28.0, [&](int step) {
                       adam_update(adam, step, 1.0, param, grad_bf16, exp_avg, exp_avg_sq, param_bf16);
                     }});
  }
  const CpuSeconds before = cpu_seconds();
  const auto wall0 = std::chrono::steady_clock::now();
  const std::vector<Timing> t = time_interleaved(cases, opt.iters, reset);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  const CpuSeconds after = cpu_seconds();
  for (size_t j = 0; j < cases.size(); ++j) print_row(cases[j].name, cases[j].bytes_per_param, n, t[j]);
  const double others = (after.machine_busy - before.machine_busy) - (after.self - before.self);
  std::printf("other processes: %.2f CPU-s during the %.1f s measured%s\n", others, wall,
              others > 0.02 * wall * num_threads() ? " (machine shared: numbers are low)" : "");
  if (!opt.stream_only) {
    // The stream kernel and the offload update both move 28 B/param, so the
    // bandwidth ratio is the inverse time ratio.
    std::printf("offload update / offload stream bandwidth: %.3f (best), %.3f (median)\n", t[1].best_s / t[3].best_s,
                t[1].median_s / t[3].median_s);
  }
  return 0;
}
