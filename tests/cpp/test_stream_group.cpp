// The StreamGroup transport (comm/stream_group.h) on the CPU backends: its
// host logic (the threads' rendezvous, the exchange of stream marks, the
// check that ranks issue the same collective) and the stream-ordered moves,
// with the multi-rank cases of stream_group_ranks.h at world sizes 2 and 4:
// on the plain CPU backend, whose comm streams are threads, with late
// completion; and on the checking backend (one per rank), whose streams
// start their work after random delays and which proves every rank's own
// accesses ordered; and host_queue, the control plane beside it, starting
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

}  // namespace

int main() {
  test_misuse();
  test_host_queue_starts_once_its_stream_is_there();
  test::check_stream_group(plain_cpu(), std::nullopt);
  test::check_stream_group(plain_cpu(), LateCompletion{11, 500});
  test::check_stream_group(checking_cpu(), LateCompletion{12, 200});
  return test::finish("test_stream_group");
}
