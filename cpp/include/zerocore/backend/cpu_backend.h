// The plain CPU backend: what CPU training runs on, with as little overhead
// as the seam allows. Every memory kind is a host arena; the compute stream
// is the calling thread, so work enqueued on it runs inline, before the call
// returns; every other stream is a WorkQueue thread. A non-compute stream is
// a thread rather than inline work because it exists to overlap with
// compute: gloo collectives on the comm stream, the offload pipeline's
// update and copies, while the caller goes on with the next unit. Events
// are the queues' completion flags; an event of the compute stream is
// complete when recorded. A stream's thread starts with its first work, so
// a stream only named in events (a comm queue's) costs no thread.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "zerocore/backend/backend.h"
#include "zerocore/backend/owned_streams.h"
#include "zerocore/runtime/event.h"

namespace zerocore {

// What the CPU backends record: the completion of a stream's work so far,
// and (checking backend only) the stream's vector clock at that point.
class CpuEvent : public StreamEvent {
 public:
  CpuEvent(std::shared_ptr<Event> done, std::vector<uint64_t> clock)
      : done_(std::move(done)), clock_(std::move(clock)) {}
  const std::shared_ptr<Event>& done() const { return done_; }
  const std::vector<uint64_t>& clock() const { return clock_; }

 private:
  std::shared_ptr<Event> done_;
  std::vector<uint64_t> clock_;
};

class CpuBackend : public Backend {
 public:
  CpuBackend();
  ~CpuBackend() override;  // finishes what every stream was given

  std::shared_ptr<Buffer> allocate(MemoryKind kind, size_t bytes, const std::string& name,
                                   bool zeroed = false) override;
  Stream& compute_stream() override;
  using Backend::create_stream;
  Stream& create_stream(const std::string& name, StreamPlane plane) override;

  std::shared_ptr<StreamEvent> record(Stream& stream) override;
  void wait(Stream& stream, const StreamEvent& event) override;
  void host_wait(const StreamEvent& event) override;
  bool query(const StreamEvent& event) override;
  std::shared_ptr<StreamEvent> record_done(Stream& stream, std::shared_ptr<Event> done) override;
  std::shared_ptr<Event> host_tail(Stream& stream) override;

  void copy(Stream& stream, const Tensor& dst, const Tensor& src) override;
  void fill(Stream& stream, const Tensor& dst, float value) override;
  void accumulate(Stream& stream, const Tensor& dst, const Tensor& src) override;
  void accumulate_on_grid(Stream& stream, const Tensor& dst, const Tensor& src, int exponent,
                          const Tensor& largest) override;
  void sum_of_squares(Stream& stream, const std::vector<Tensor>& xs, Mailbox& box, int sum_slot,
                      int finite_slot) override;
  void count_nonfinite(Stream& stream, const std::vector<Tensor>& xs, const Tensor& counter) override;
  void adam_update_runs(Stream& stream, const std::vector<AdamOptions>& groups, int64_t step, double grad_scale,
                        const std::vector<FlatRun>& runs, const Tensor& skip_if) override;
  void sgd_update_runs(Stream& stream, const std::vector<SgdOptions>& groups, int64_t step, double grad_scale,
                       const std::vector<FlatRun>& runs, const Tensor& skip_if) override;
  bool compute_runs_inline() const override { return true; }
  void enqueue(Stream& stream, const std::string& op, const std::vector<Access>& accesses,
               std::function<void()> body) override;

  void declare_access(Stream& stream, const Access& access, const std::string& op) override;
  void declare_host_access(const Access& access, const std::string& op) override;
  void poison(Stream& stream, const Tensor& range) override;

 protected:
  // Called by each kernel before it is enqueued: nothing here (a CPU kernel
  // runs on any memory); the checking backend checks what CUDA needs.
  virtual void check_kernel_memory(const std::string& op, const KernelOperands& operands) const;
  // Streams are numbered in creation order; the compute stream is 0.
  static constexpr int kCompute = 0;
  int index_of(const Stream& stream) const;
  // The backend's own record, with `clock` attached.
  std::shared_ptr<CpuEvent> record_with(Stream& stream, std::vector<uint64_t> clock);

 private:
  struct CpuStream;
  OwnedStreams<CpuStream> streams_;
  CpuStream* compute_;  // the first of streams_, read without their lock
};

// The process's plain CPU backend: what the runtime allocates through when
// it is given no backend. It has only the compute stream until a caller
// creates another.
CpuBackend& default_cpu_backend();

}  // namespace zerocore
