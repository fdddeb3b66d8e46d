// A fixed pool of worker threads for the data-parallel CPU kernels. The
// calling thread takes part, so a pool of size n runs n chunks at once.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace zerocore {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }

  // Splits [0, n) into at most size() contiguous chunks whose boundaries are
  // multiples of `align` and runs fn(begin, end) on each, one per thread.
  // Returns when all chunks are done. Callers on several threads (ranks as
  // threads, Python threads: the bindings release the GIL) take turns; a
  // call from inside fn is not allowed.
  void parallel_for(int64_t n, int64_t align, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // one parallel_for at a time on the workers
  std::mutex mutex_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int64_t, int64_t)>* task_ = nullptr;
  std::vector<std::pair<int64_t, int64_t>> chunks_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stopping_ = false;
};

// One parallel_for over several ranges at once (lengths[i] elements each,
// laid end to end, each starting on an `align` boundary): fn(i, begin, end)
// runs on each piece of range i that a chunk covers. Many small ranges cost
// one fork-join instead of one each.
void parallel_for_ranges(ThreadPool& pool, const std::vector<int64_t>& lengths, int64_t align,
                         const std::function<void(size_t, int64_t, int64_t)>& fn);

// The process-wide pool the optimizers use. Its size defaults to the CPUs
// this process may run on; set_num_threads() replaces it.
ThreadPool& default_thread_pool();
void set_num_threads(int threads);
int num_threads();

}  // namespace zerocore
