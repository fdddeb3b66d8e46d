#include "zerocore/runtime/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <memory>
#include <new>

#include "zerocore/error.h"

namespace zerocore {

ThreadPool::ThreadPool(int threads) {
  if (threads < 1) throw InvalidArgument("thread count must be at least 1");
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void parallel_for_ranges(ThreadPool& pool, const std::vector<int64_t>& lengths, int64_t align,
                         const std::function<void(size_t, int64_t, int64_t)>& fn) {
  align = std::max<int64_t>(align, 1);
  std::vector<int64_t> start(lengths.size() + 1, 0);
  for (size_t i = 0; i < lengths.size(); ++i) start[i + 1] = start[i] + (lengths[i] + align - 1) / align * align;
  pool.parallel_for(start.back(), align, [&](int64_t b, int64_t e) {
    size_t i = size_t(std::upper_bound(start.begin(), start.end(), b) - start.begin()) - 1;
    for (; i < lengths.size() && start[i] < e; ++i) {
      const int64_t lo = std::max(b, start[i]) - start[i];
      const int64_t hi = std::min(e - start[i], lengths[i]);
      if (lo < hi) fn(i, lo, hi);
    }
  });
}

void ThreadPool::parallel_for(int64_t n, int64_t align,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  align = std::max<int64_t>(align, 1);
  // Equal chunks rounded to `align`, so no two threads share a cache line
  // and every chunk but the last runs whole SIMD vectors.
  const int64_t per = (n + size() - 1) / size();
  const int64_t chunk = (per + align - 1) / align * align;
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (int64_t b = 0; b < n; b += chunk) chunks.emplace_back(b, std::min(n, b + chunk));
  if (chunks.size() == 1 || workers_.empty()) {
    for (auto& c : chunks) fn(c.first, c.second);
    return;
  }
  std::lock_guard<std::mutex> turn(call_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    task_ = &fn;
    chunks_ = std::move(chunks);
    pending_ = int(chunks_.size()) - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  fn(chunks_[0].first, chunks_[0].second);  // the caller takes chunk 0
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  task_ = nullptr;
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    std::unique_lock<std::mutex> lock(mutex_);
    start_cv_.wait(lock, [&] { return stopping_ || generation_ != seen; });
    if (stopping_) return;
    seen = generation_;
    if (size_t(index) >= chunks_.size()) continue;  // fewer chunks than threads
    const auto chunk = chunks_[index];
    const auto* task = task_;
    lock.unlock();
    (*task)(chunk.first, chunk.second);
    lock.lock();
    if (--pending_ == 0) done_cv_.notify_one();
  }
}

namespace {

int available_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

std::mutex g_pool_mutex;
std::unique_ptr<ThreadPool> g_pool;

// A forked child inherits the pool object but none of its threads: waiting
// on them would hang. The child abandons the object (joining threads that
// do not exist is not possible) and builds a fresh pool on first use.
void abandon_pool_in_child() {
  g_pool.release();  // NOLINT: deliberately leaked
  new (&g_pool_mutex) std::mutex;
}

std::once_flag g_atfork_once;

}  // namespace

ThreadPool& default_thread_pool() {
  std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, abandon_pool_in_child); });
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (!g_pool) g_pool = std::make_unique<ThreadPool>(available_cpus());
  return *g_pool;
}

void set_num_threads(int threads) {
  default_thread_pool();  // registers the fork handler
  if (threads < 1) throw InvalidArgument("num_threads must be at least 1, got " + std::to_string(threads));
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  g_pool = std::make_unique<ThreadPool>(threads);
}

int num_threads() { return default_thread_pool().size(); }

}  // namespace zerocore
