// The StreamGroup transport (comm/stream_group.h) on the CPU backends: its
// host logic (the threads' rendezvous, the exchange of stream marks, the
// check that ranks issue the same collective) and the stream-ordered moves,
// with the multi-rank cases of stream_group_ranks.h at world sizes 2 and 4:
// on the plain CPU backend, whose comm streams are threads, with late
// completion; and on the checking backend (one per rank), whose streams
// start their work after random delays and which proves every rank's own
// accesses ordered; one rank's failing stream work failing the collective
// on every rank; and host_queue, the control plane beside it, starting
// each collective once its stream is there. cuda/tests/test_cuda_ranks.cpp runs the same cases on
// one GPU.
#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "check.h"
#include "stream_group_ranks.h"

using namespace zerocore;

namespace {

test::RankDevices plain_cpu() {
  return {[](int) { return std::make_unique<CpuBackend>(); }, cpu_group_stream};
}

test::RankDevices checking_cpu() {
  test::RankDevices devices{
      [](int rank) {
        CheckingOptions options;
        options.seed = uint64_t(rank) + 7;
        return std::make_unique<CheckingCpuBackend>(options);
      },
      cpu_group_stream};
  devices.verdict = [](Backend& backend) {
    const std::vector<std::string> found = static_cast<CheckingCpuBackend&>(backend).violations();
    return found.empty() ? std::string() : found.front();
  };
  return devices;
}

// A transport's misuse: a rank outside the group, a stream set twice, and a
// collective before any stream, which throws on every rank (its peers
// would otherwise wait in the rendezvous for ever).
void test_misuse() {
  StreamGroup group(2);
  bool threw = false;
  try {
    group.transport(2);
  } catch (const InvalidArgument&) {
    threw = true;
  }
  CHECK(threw);
  CpuBackend backend;
  auto transport = group.transport(0);
  transport->issue_on(cpu_group_stream(backend, backend.create_stream("comm")));
  threw = false;
  try {
    transport->issue_on(cpu_group_stream(backend, backend.create_stream("comm")));
  } catch (const std::logic_error&) {
    threw = true;
  }
  CHECK(threw);

  StreamGroup unset(2);
  std::atomic<int> refused{0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      CpuBackend b;
      auto t = unset.transport(r);
      if (r == 1) t->issue_on(cpu_group_stream(b, b.create_stream("comm")));
      const Tensor x = Tensor::empty({4}, DType::kFloat32);
      try {
        t->all_reduce({CollectiveKind::kAllReduce, 0, 0, 4}, x);
      } catch (const InvalidArgument& e) {
        if (std::string(e.what()).find("no stream yet") != std::string::npos) ++refused;
      }
    });
  }
  for (auto& t : ranks) t.join();
  CHECK(refused == 2);
}

// host_queue: a control collective reads host data that work on another
// stream writes late, ordered only by its queue's stream waiting for that
// stream: the collective starts once its stream has got there.
void test_host_queue_starts_once_its_stream_is_there() {
  InProcessGroup group(2);
  std::atomic<int> bad{0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      CpuBackend backend;
      std::unique_ptr<CommQueue> control = host_queue(group, r, backend);
      Stream& writer = backend.create_stream("writer");
      const Tensor row = Tensor::zeros({16}, DType::kFloat32);
      backend.enqueue(writer, "a late write", {}, [row, r] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        fill(row, float(r + 1));
      });
      backend.wait(control->stream(), *backend.record(writer));
      backend.host_wait(*control->all_reduce({CollectiveKind::kAllReduce, -1, 0, 16}, row));
      for (int64_t i = 0; i < 16; ++i) bad += row.data_as<float>()[i] != 3.0f;
    });
  }
  for (auto& t : ranks) t.join();
  CHECK(bad == 0);
}

// A CPU stream whose sums fail at issue (a CUDA launch that fails would).
class FailingSums final : public GroupStream {
 public:
  explicit FailingSums(std::unique_ptr<GroupStream> inner) : inner_(std::move(inner)) {}
  std::shared_ptr<Mark> mark() override { return inner_->mark(); }
  void wait(const Mark& peer) override { inner_->wait(peer); }
  void copy(const Tensor& dst, const Tensor& src) override { inner_->copy(dst, src); }
  void zero(const Tensor& dst) override { inner_->zero(dst); }
  void add(const Tensor&, const Tensor&) override { throw std::runtime_error("the sum kernel failed to launch"); }
  void delay(int microseconds) override { inner_->delay(microseconds); }
  Backend& backend() override { return inner_->backend(); }
  Completion completion(std::shared_ptr<Mark> end) override { return inner_->completion(std::move(end)); }

 private:
  std::unique_ptr<GroupStream> inner_;
};

// Stream work that fails on one rank (after the rendezvous) fails the
// collective on every rank, naming that rank and why, instead of leaving
// the others waiting for it.
void test_a_ranks_failing_stream_work_fails_every_rank() {
  for (int world : {2, 4}) {
    std::atomic<int> named{0};
    test::RankDevices devices = plain_cpu();
    devices.flavour = [](Backend& backend, Stream& stream) -> std::unique_ptr<GroupStream> {
      auto cpu = cpu_group_stream(backend, stream);
      if (stream.name() == "comm (rank 1)") return std::make_unique<FailingSums>(std::move(cpu));
      return cpu;
    };
    test::on_group_ranks(world, devices, std::nullopt, [&](int, Backend& backend, CommQueue& q, CommQueue&) {
      const Tensor t = test::on_device(backend, std::vector<float>(8, 1.0f));
      try {
        backend.host_wait(*q.all_reduce({CollectiveKind::kAllReduce, 0, 0, 8}, t));
      } catch (const std::runtime_error& e) {
        const std::string said = e.what();
        if (said.find("rank 1's stream work failed: the sum kernel failed to launch") != std::string::npos) ++named;
      }
    });
    CHECK(named == world);
  }
}

// Config(deterministic=True)'s int64 sums: added as integers, exactly (past
// fp32's 24 bits and float64's 53), in an all-reduce and a reduce-scatter.
void test_int64_sums_are_exact() {
  constexpr int kWorld = 3;
  constexpr int64_t kN = 6;
  const auto value = [](int rank, int64_t i) { return (int64_t(1) << 60) / 7 * (i % 2 ? -1 : 1) + rank * 3 + i; };
  std::atomic<int> bad{0};
  test::on_group_ranks(kWorld, plain_cpu(), std::nullopt, [&](int rank, Backend& backend, CommQueue& q, CommQueue&) {
    const Tensor host = Tensor::empty({kWorld * kN}, DType::kInt64);
    for (int64_t i = 0; i < kWorld * kN; ++i) host.data_as<int64_t>()[i] = value(rank, i);
    const Tensor all = Tensor::empty({kWorld * kN}, DType::kInt64, backend, MemoryKind::kDevice, "sums");
    const Tensor shard = Tensor::empty({kN}, DType::kInt64, backend, MemoryKind::kDevice, "shard");
    backend.copy(backend.compute_stream(), all, host);
    backend.host_wait(*backend.record(backend.compute_stream()));
    backend.host_wait(*q.reduce_scatter({CollectiveKind::kReduceScatter, 0, 0, kWorld * kN}, all, shard));
    backend.host_wait(*q.all_reduce({CollectiveKind::kAllReduce, 0, 1, kWorld * kN}, all));
    const auto want = [&](int64_t i) {
      int64_t s = 0;
      for (int r = 0; r < kWorld; ++r) s += value(r, i);
      return s;
    };
    for (int64_t i = 0; i < kN; ++i) bad += shard.data_as<int64_t>()[i] != want(rank * kN + i);
    for (int64_t i = 0; i < kWorld * kN; ++i) bad += all.data_as<int64_t>()[i] != want(i);
  });
  CHECK(bad == 0);
}

}  // namespace

int main() {
  test_misuse();
  test_host_queue_starts_once_its_stream_is_there();
  test_a_ranks_failing_stream_work_fails_every_rank();
  test_int64_sums_are_exact();
  test::check_stream_group(plain_cpu(), std::nullopt);
  test::check_stream_group(plain_cpu(), LateCompletion{11, 500});
  test::check_stream_group(checking_cpu(), LateCompletion{12, 200});
  return test::finish("test_stream_group");
}
