// The CPU backends' GroupStream (comm/stream_group.h).
#include <chrono>
#include <cstring>
#include <thread>

#include "zerocore/backend/cpu_backend.h"
#include "zerocore/comm/stream_group.h"
#include "zerocore/error.h"
#include "zerocore/kernels/cpu_accumulate.h"
#include "zerocore/kernels/cpu_fill.h"

namespace zerocore {

namespace {

// The stream's completion flag at the mark.
struct CpuMark final : GroupStream::Mark {
  explicit CpuMark(std::shared_ptr<Event> done) : done(std::move(done)) {}
  std::shared_ptr<Event> done;
};

class CpuGroupStream final : public GroupStream {
 public:
  CpuGroupStream(Backend& backend, Stream& stream) : backend_(backend), stream_(stream) {}

  std::shared_ptr<Mark> mark() override {
    const auto* event = dynamic_cast<const CpuEvent*>(backend_.record(stream_).get());
    if (!event) throw InvalidArgument("cpu_group_stream: the backend is not a CPU backend");
    return std::make_shared<CpuMark>(event->done());
  }
  void wait(const Mark& peer) override {
    const auto* m = dynamic_cast<const CpuMark*>(&peer);
    if (!m) throw InvalidArgument("cpu_group_stream: a peer's mark is of another flavour");
    on_stream("wait for a peer", [done = m->done] { done->wait(); });
  }
  void copy(const Tensor& dst, const Tensor& src) override {
    on_stream("copy", [dst, src] { std::memcpy(dst.data(), src.data(), dst.nbytes()); });
  }
  void zero(const Tensor& dst) override {
    on_stream("zero", [dst] { fill(dst, 0.0f); });
  }
  void add(const Tensor& dst, const Tensor& src) override {
    on_stream("add", [dst, src] { accumulate(dst, src); });
  }
  void delay(int microseconds) override {
    on_stream("delay", [microseconds] { std::this_thread::sleep_for(std::chrono::microseconds(microseconds)); });
  }
  Backend& backend() override { return backend_; }
  Completion completion(std::shared_ptr<Mark> end) override {
    return [done = static_cast<const CpuMark&>(*end).done] { done->wait(); };
  }

 private:
  template <class Body>
  void on_stream(const char* op, Body body) {
    backend_.enqueue(stream_, std::string("stream group: ") + op, {}, std::move(body));
  }

  Backend& backend_;
  Stream& stream_;
};

}  // namespace

std::unique_ptr<GroupStream> cpu_group_stream(Backend& backend, Stream& stream) {
  return std::make_unique<CpuGroupStream>(backend, stream);
}

}  // namespace zerocore
