#include "python_transport.h"

#include <condition_variable>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "dlpack_tensor.h"

namespace nb = nanobind;

namespace zerocore::bindings {

namespace {

PyObject* rank_disagreement_type = nullptr;  // register_rank_disagreement's, kept for the interpreter's life

class TransportFailed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The views of the queue's tensors that Python holds. A collective completes,
// but the backend may drop its last view a moment later, on
// its own thread (gloo's worker lets go of a finished work after waking its
// waiter). The transport waits for every view before it goes, so closing the
// queue means its tensors' memory is free (or back with its other holders).
class LentViews {
 public:
  Tensor lend(const Tensor& t) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++live_;
    }
    std::shared_ptr<void> returned(nullptr, [this, owner = t.owner()](void*) mutable {
      owner.reset();
      std::lock_guard<std::mutex> lock(mutex_);
      if (--live_ == 0) cv_.notify_all();
    });
    return Tensor(t.data(), t.dtype(), t.device(), t.shape(), std::move(returned));
  }

  // A view's last holder may need the GIL to let go (torch's DLPack
  // deleter takes it), so the GIL is released while waiting.
  void wait_all_returned() {
    std::optional<nb::gil_scoped_release> unlocked;
    if (PyGILState_Check()) unlocked.emplace();
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this] { return live_ == 0; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int64_t live_ = 0;
};

class PythonTransport final : public Transport {
 public:
  explicit PythonTransport(nb::object impl)
      : impl_(std::move(impl)),
        rank_(nb::cast<int>(impl_.attr("rank"))),
        world_size_(nb::cast<int>(impl_.attr("world_size"))) {}

  // Destroyed by whoever drops the queue, with or without the GIL.
  ~PythonTransport() override {
    if (!Py_IsInitialized()) {
      impl_.release();  // after interpreter shutdown the object is left to the OS
      return;
    }
    lent_.wait_all_returned();
    nb::gil_scoped_acquire gil;
    impl_.reset();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  Completion all_gather(const CollectiveKey& key, const Tensor& shard, const Tensor& output) override {
    return issue(key, "all_gather", shard, output);
  }
  Completion reduce_scatter(const CollectiveKey& key, const Tensor& input, const Tensor& shard) override {
    return issue(key, "reduce_scatter", input, shard);
  }
  Completion all_reduce(const CollectiveKey& key, const Tensor& tensor) override {
    return issue(key, "all_reduce", tensor);
  }
  Completion broadcast(const CollectiveKey& key, const Tensor& tensor, int root) override {
    return issue(key, "broadcast", tensor, root);
  }

 private:
  // Calls the method; what it returns (None, or a callable that blocks until
  // the collective is done) becomes the completion, called on the queue's
  // completing thread.
  template <class... Args>
  Completion issue(const CollectiveKey& key, const char* method, const Args&... args) {
    nb::gil_scoped_acquire gil;
    nb::object finish = raising_as_cpp(key, method, [&] { return impl_.attr(method)(key_tuple(key), to_python(args)...); });
    if (finish.is_none()) return {};
    // The callable holds the tensors' views: it goes, under the GIL, once called.
    auto held = std::shared_ptr<nb::object>(new nb::object(std::move(finish)), [](nb::object* f) {
      if (!Py_IsInitialized()) return;  // after interpreter shutdown the object is left to the OS
      nb::gil_scoped_acquire gil;
      delete f;
    });
    return [key, method, held = std::move(held)] {
      nb::gil_scoped_acquire gil;
      raising_as_cpp(key, method, [&] { return (*held)(); });
      *held = nb::none();
    };
  }

  // Runs `call` (with the GIL); a Python exception becomes the C++ error
  // the queue carries to Event.wait().
  template <class Call>
  static nb::object raising_as_cpp(const CollectiveKey& key, const char* method, Call&& call) {
    try {
      return call();
    } catch (const nb::python_error& e) {
      if (e.matches(PyExc_TimeoutError)) throw CollectiveTimeout(nb::str(e.value()).c_str());
      if (rank_disagreement_type && e.matches(rank_disagreement_type)) {
        throw RankDisagreement(nb::str(e.value()).c_str());
      }
      throw TransportFailed(describe(key) + ": the transport's " + method + " raised " +
                            nb::type_name(e.type()).c_str() + ": " + nb::str(e.value()).c_str());
    }
  }

  nb::object to_python(const Tensor& t) { return nb::cast(tensor_to_ndarray(lent_.lend(t))); }
  static nb::object to_python(int value) { return nb::int_(value); }

  LentViews lent_;
  nb::object impl_;
  const int rank_;
  const int world_size_;
};

}  // namespace

void register_rank_disagreement(nb::handle type) {
  Py_XDECREF(rank_disagreement_type);
  rank_disagreement_type = type.ptr();
  Py_INCREF(rank_disagreement_type);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const RankDisagreement& e) {
      PyErr_SetString(rank_disagreement_type, e.what());
    }
  });
}

void rethrow_for_native(const nb::python_error& e) {
  if (rank_disagreement_type && e.matches(rank_disagreement_type)) throw RankDisagreement(nb::str(e.value()).c_str());
  throw e;
}

nb::tuple key_tuple(const CollectiveKey& key) {
  return nb::make_tuple(int(key.kind), key.group, key.bucket, key.numel);
}

std::unique_ptr<Transport> python_transport(nb::object impl) {
  return std::make_unique<PythonTransport>(std::move(impl));
}

}  // namespace zerocore::bindings
