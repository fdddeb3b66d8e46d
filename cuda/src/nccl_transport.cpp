// The native NCCL transport (nccl_transport.h).
//
// Why a watchdog thread of the transport's own: NCCL's calls return once a
// collective is queued on the stream, and a collective whose peer never
// joins simply never finishes on the device; nothing returns an error. So
// each collective is watched, in issue order, by polling an event recorded
// after it (cudaEventQuery) together with the communicator's asynchronous
// error (ncclCommGetAsyncError); past the timeout the watchdog aborts the
// communicator (ncclCommAbort, which ends its kernels, so the streams that
// wait for them move on) and keeps the error (CollectiveTimeout naming the
// collective), which the next collective issued throws, so the queue fails
// every later one with it. A collective's own completion is empty: the
// queue sets its event at issue and the CUDA backend records it on the comm
// stream right after the collective, so whoever waits for it waits on the
// device and the host runs ahead, as torch's ProcessGroupNCCL and its
// watchdog do. (A completion that watched would set the event only once the
// collective finished, and every stream wait for it would block its host
// thread until then.)
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

#include "cuda_check.h"
#include "nccl_library.h"
#include "zerocore/error.h"

namespace zerocore {

namespace {

using cuda_detail::check;

// How often the watchdog looks at the collective it watches: it decides
// only how soon an error is seen (a collective's completion does not wait
// for it), so seldom enough that the thread costs the host nothing.
constexpr std::chrono::milliseconds kPollInterval{1};

ncclDataType_t nccl_dtype(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kInt64:
      return ncclInt64;
    case DType::kInt40:  // a partition's sums, never reduced: the staging crosses as int64
      break;
  }
  throw InvalidArgument("NCCL transport: unknown dtype");
}

// An event recorded after one collective, destroyed with its completion.
class RecordedEvent {
 public:
  explicit RecordedEvent(cudaStream_t stream) {
    check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    const cudaError_t recorded = cudaEventRecord(event_, stream);
    if (recorded != cudaSuccess) (void)cudaEventDestroy(event_);
    check(recorded, "cudaEventRecord");
  }
  ~RecordedEvent() { (void)cudaEventDestroy(event_); }
  RecordedEvent(const RecordedEvent&) = delete;
  RecordedEvent& operator=(const RecordedEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

class NativeNcclTransport;

// The transport's monitor (NcclMonitor): it reaches the transport while
// the transport lives (detach, from its destructor, ends that).
class TransportMonitor final : public NcclMonitor {
 public:
  explicit TransportMonitor(NativeNcclTransport* transport) : transport_(transport) {}
  NcclProgress progress() const override;
  void abort(const std::string& reason) override;
  void detach() {
    std::lock_guard<std::mutex> lock(mutex_);
    transport_ = nullptr;
  }

 private:
  mutable std::mutex mutex_;
  NativeNcclTransport* transport_;
};

class NativeNcclTransport final : public NcclTransport {
 public:
  NativeNcclTransport(std::shared_ptr<const NcclLibrary> nccl, const std::string& unique_id,
                      const NcclTransportOptions& options)
      : nccl_(std::move(nccl)), options_(options) {
    ncclUniqueId id;
    if (unique_id.size() != sizeof(id.internal)) {
      throw InvalidArgument("NCCL transport: a unique id is " + std::to_string(sizeof(id.internal)) +
                            " bytes (ncclGetUniqueId's), got " + std::to_string(unique_id.size()));
    }
    unique_id.copy(id.internal, sizeof(id.internal));
    // NCCL binds the communicator to the current device.
    cuda_detail::DeviceGuard guard(options_.device);
    nccl_->check(nccl_->comm_init_rank(&comm_, options_.world_size, id, options_.rank), "ncclCommInitRank", nullptr);
  }

  // The queue is drained by now: nothing more is issued. The watchdog sees
  // what was issued finish (or times it out) first. A failed destroy is
  // left unreported: a destructor must not throw, and the process is
  // letting go of the communicator either way.
  ~NativeNcclTransport() override {
    monitor_->detach();
    {
      std::lock_guard<std::mutex> lock(watch_mutex_);
      stopping_ = true;
    }
    watch_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    if (aborted_) return;
    cuda_detail::DeviceGuard guard(options_.device);
    (void)nccl_->comm_destroy(comm_);
  }

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  void issue_on(void* stream) override { stream_ = static_cast<cudaStream_t>(stream); }
  std::shared_ptr<NcclMonitor> monitor() override { return monitor_; }

  // TransportMonitor's: the oldest collective not done, from its entering
  // NCCL (which may wait for the peers to connect) until its event.
  NcclProgress progress() {
    std::lock_guard<std::mutex> lock(watch_mutex_);
    NcclProgress out;
    out.issued = issued_;
    const Watched* oldest = !watched_.empty() ? &watched_.front() : calling_ ? &*calling_ : nullptr;
    if (oldest) {
      out.oldest = oldest->index;
      out.key = oldest->key;
      out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - oldest_since_).count();
    }
    return out;
  }

  // TransportMonitor's: the ranks are apart; the next issue throws.
  void abort_for(const std::string& reason) {
    {
      std::lock_guard<std::mutex> lock(watch_mutex_);
      if (!failed_) failed_ = std::make_exception_ptr(RankDisagreement(reason));
    }
    abort();
  }

  Completion all_gather(const CollectiveKey& key, const Tensor& shard, const Tensor& output) override {
    check_operands(key, {&shard, &output}, output.numel() == shard.numel() * options_.world_size);
    return issue(key, "ncclAllGather", [&] {
      return nccl_->all_gather(shard.data(), output.data(), size_t(shard.numel()), nccl_dtype(shard.dtype()), comm_,
                               stream_);
    });
  }

  Completion reduce_scatter(const CollectiveKey& key, const Tensor& input, const Tensor& shard) override {
    check_operands(key, {&input, &shard}, input.numel() == shard.numel() * options_.world_size);
    return issue(key, "ncclReduceScatter", [&] {
      return nccl_->reduce_scatter(input.data(), shard.data(), size_t(shard.numel()), nccl_dtype(shard.dtype()),
                                   ncclSum, comm_, stream_);
    });
  }

  Completion all_reduce(const CollectiveKey& key, const Tensor& tensor) override {
    check_operands(key, {&tensor}, true);
    return issue(key, "ncclAllReduce", [&] {
      return nccl_->all_reduce(tensor.data(), tensor.data(), size_t(tensor.numel()), nccl_dtype(tensor.dtype()),
                               ncclSum, comm_, stream_);
    });
  }

  Completion broadcast(const CollectiveKey& key, const Tensor& tensor, int root) override {
    check_operands(key, {&tensor}, root >= 0 && root < options_.world_size);
    return issue(key, "ncclBroadcast", [&] {
      return nccl_->broadcast(tensor.data(), tensor.data(), size_t(tensor.numel()), nccl_dtype(tensor.dtype()), root,
                              comm_, stream_);
    });
  }

 private:
  // Every operand is memory of this transport's device, of one dtype, and
  // `sizes_agree` (the collective's own size rule) holds.
  void check_operands(const CollectiveKey& key, std::initializer_list<const Tensor*> operands,
                      bool sizes_agree) const {
    const Device device{DeviceType::kCUDA, options_.device};
    for (const Tensor* t : operands) {
      if (t->device() != device || t->dtype() != (*operands.begin())->dtype()) {
        throw InvalidArgument(describe(key) + ": the NCCL transport moves tensors of one dtype on CUDA device " +
                              std::to_string(options_.device) + " (its queue's); copy the operands there first");
      }
    }
    if (!sizes_agree) {
      throw InvalidArgument(describe(key) + ": its operands' sizes (or root) do not fit the collective over " +
                            std::to_string(options_.world_size) + " ranks");
    }
  }

  // Issues one collective on the comm stream and hands it to the watchdog;
  // its completion is empty (see the top of the file). The device is made
  // current on the issuing thread first. What the watchdog found (a
  // timeout, NCCL's error) is thrown here, at the next collective.
  template <class Call>
  Completion issue(const CollectiveKey& key, const char* what, Call&& call) {
    if (!stream_) {
      throw std::logic_error(describe(key) + ": the NCCL transport has no stream yet (issue_on is called when its "
                             "queue is made)");
    }
    int64_t index = 0;
    {
      std::lock_guard<std::mutex> lock(watch_mutex_);
      if (failed_) std::rethrow_exception(failed_);
      index = ++issued_;
      if (watched_.empty()) oldest_since_ = std::chrono::steady_clock::now();
      calling_ = Watched{key, nullptr, index};
    }
    std::shared_ptr<RecordedEvent> done;
    try {
      check(cudaSetDevice(options_.device), "cudaSetDevice");
      std::lock_guard<std::timed_mutex> lock(calling_mutex_);
      if (aborted_) throw std::runtime_error("zerocore: " + describe(key) + ": the NCCL communicator was aborted");
      const ncclResult_t result = call();
      if (result != ncclSuccess) {
        throw std::runtime_error("zerocore: " + nccl_->error((describe(key) + ": " + what).c_str(), result, comm_));
      }
      done = std::make_shared<RecordedEvent>(stream_);
    } catch (...) {
      std::lock_guard<std::mutex> lock(watch_mutex_);
      calling_.reset();
      throw;
    }
    {
      std::lock_guard<std::mutex> lock(watch_mutex_);
      calling_.reset();
      watched_.push_back(Watched{key, std::move(done), index});
      if (!watchdog_.joinable()) watchdog_ = std::thread([this] { watch(); });
    }
    watch_cv_.notify_one();
    return {};
  }

  struct Watched {
    CollectiveKey key;
    std::shared_ptr<RecordedEvent> done;
    int64_t index = 0;  // its number on this transport, from 1
  };

  // The watchdog: each collective in issue order until it finished on the
  // device; on NCCL's error or past the timeout it aborts the communicator
  // and keeps the error for the next issue. A collective's clock starts
  // once the one before it finished, so waiting behind it is not counted.
  void watch() {
    (void)cudaSetDevice(options_.device);
    for (;;) {
      Watched next;
      {
        std::unique_lock<std::mutex> lock(watch_mutex_);
        watch_cv_.wait(lock, [this] { return stopping_ || !watched_.empty(); });
        if (watched_.empty()) return;  // stopping, with nothing left to see finish
        next = watched_.front();
      }
      std::exception_ptr error;
      try {
        wait_for(next.key, next.done->get());
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(watch_mutex_);
      watched_.pop_front();
      oldest_since_ = std::chrono::steady_clock::now();
      if (error) {
        if (!failed_) failed_ = error;
        watched_.clear();  // aborted: the rest end with the communicator's kernels
      }
    }
  }

  // Returns once the collective finished on the device; throws (aborting
  // the communicator) when NCCL reports an error or the timeout passes.
  void wait_for(const CollectiveKey& key, cudaEvent_t done) {
    const auto start = std::chrono::steady_clock::now();
    const auto timeout = std::chrono::duration<double>(options_.timeout_seconds);
    for (;;) {
      const cudaError_t state = cudaEventQuery(done);
      if (state == cudaSuccess) return;
      if (state != cudaErrorNotReady) check(state, (describe(key) + ": cudaEventQuery").c_str());
      ncclResult_t async = ncclSuccess;
      nccl_->check(nccl_->comm_get_async_error(comm_, &async), "ncclCommGetAsyncError", comm_);
      if (async != ncclSuccess && async != ncclInProgress) {
        const std::string message = nccl_->error(describe(key).c_str(), async, comm_);
        abort();
        throw std::runtime_error("zerocore: NCCL failed in the " + message + "; the communicator was aborted");
      }
      if (std::chrono::steady_clock::now() - start > timeout) {
        abort();
        throw CollectiveTimeout(timeout_message(key));
      }
      std::this_thread::sleep_for(kPollInterval);
    }
  }

  // ncclCommAbort ends the communicator's kernels (the stream moves on) and
  // frees it. It waits a moment for an issue in progress to leave NCCL, but
  // not for ever: an issue stuck inside NCCL (connecting to a dead peer) is
  // what an abort is for. Its own result is not checked: it runs on the way
  // to throwing the error that made it, which says more.
  void abort() {
    std::unique_lock<std::timed_mutex> lock(calling_mutex_, std::defer_lock);
    (void)lock.try_lock_for(std::chrono::seconds(1));
    if (aborted_.exchange(true)) return;
    (void)nccl_->comm_abort(comm_);
  }

  std::string timeout_message(const CollectiveKey& key) const {
    std::ostringstream text;
    text << "zerocore: the " << describe(key) << " timed out after " << options_.timeout_seconds
         << " s waiting for the other " << options_.world_size - 1
         << " rank(s) of its NCCL communicator; a peer is stuck or dead. The communicator was aborted "
            "(ncclCommAbort): every later collective of this engine fails at once, so end the job and restart it "
            "(from a checkpoint); raise Config(timeout=...) if a peer is only slow.";
    return text.str();
  }

  const std::shared_ptr<const NcclLibrary> nccl_;
  const NcclTransportOptions options_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::timed_mutex calling_mutex_;  // held while the issuing thread is inside NCCL
  std::atomic<bool> aborted_{false};
  // The watchdog's: what it still watches, and the error it found.
  std::mutex watch_mutex_;
  std::condition_variable watch_cv_;
  std::deque<Watched> watched_;
  std::optional<Watched> calling_;  // the collective the issuing thread is issuing, until watched
  int64_t issued_ = 0;
  std::chrono::steady_clock::time_point oldest_since_;  // when the oldest not done became so
  std::exception_ptr failed_;
  bool stopping_ = false;
  std::thread watchdog_;  // started with the first collective
  const std::shared_ptr<TransportMonitor> monitor_ = std::make_shared<TransportMonitor>(this);
};

NcclProgress TransportMonitor::progress() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return transport_ ? transport_->progress() : NcclProgress{};
}

void TransportMonitor::abort(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (transport_) transport_->abort_for(reason);
}

}  // namespace

std::unique_ptr<NcclTransport> nccl_transport(std::shared_ptr<const NcclLibrary> nccl, const std::string& unique_id,
                                              const NcclTransportOptions& options) {
  if (!nccl) throw InvalidArgument("nccl_transport: no NCCL library given (load_nccl)");
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    throw InvalidArgument("nccl_transport: rank " + std::to_string(options.rank) + " of world size " +
                          std::to_string(options.world_size));
  }
  if (!(options.timeout_seconds > 0)) throw InvalidArgument("nccl_transport: the timeout must be positive");
  return std::make_unique<NativeNcclTransport>(std::move(nccl), unique_id, options);
}

}  // namespace zerocore
