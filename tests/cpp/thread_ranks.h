// Ranks as threads for the C++ tests: fn(rank, queue) on `world` threads of
// this process, each with its own comm queue over one in-process group, on
// the process's plain CPU backend.
// ZEROCORE_LATE_COMPLETION=<seed> (ctest runs the comm and schedule tests
// both ways) makes the groups complete late, as NCCL does: the tests' own
// references then check that every reader waits for its collective.
#pragma once
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "zerocore/backend/cpu_backend.h"
#include "zerocore/comm/comm.h"

namespace zerocore::test {
inline void on_ranks(int world, const std::function<void(int, CommQueue&)>& fn) {
  InProcessGroup group(world, late_completion_from_env());
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      CommQueue queue(group.transport(r), default_cpu_backend());
      fn(r, queue);
    });
  }
  for (auto& t : threads) t.join();
}

// The same with a second queue per rank, over a group of its own: the unit
// schedule's rounds.
inline void on_ranks_with_rounds(int world, const std::function<void(int, CommQueue&, CommQueue&)>& fn) {
  InProcessGroup rounds(world, late_completion_from_env());
  on_ranks(world, [&](int r, CommQueue& q) {
    CommQueue rq(rounds.transport(r), q.backend());
    fn(r, q, rq);
  });
}

// Both queues of each rank on a backend of its own, made by make(rank) (a
// std::unique_ptr<B>): the tests of what a step orders on its backend.
template <class B, class Make>
void on_ranks_with_backends(int world, Make make, const std::function<void(int, B&, CommQueue&, CommQueue&)>& fn) {
  InProcessGroup data_group(world, late_completion_from_env()), control_group(world, late_completion_from_env());
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      const std::unique_ptr<B> backend = make(r);
      CommQueue data(data_group.transport(r), *backend), control(control_group.transport(r), *backend);
      fn(r, *backend, data, control);
    });
  }
  for (auto& t : threads) t.join();
}
}  // namespace zerocore::test
