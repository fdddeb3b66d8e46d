// The meeting of ranks that are threads of one process, at each collective:
// every rank publishes what it passed (its key, tensors, root and its own
// argument check), waits for the others, and checks everyone's, so a bad
// argument or a mismatched key fails on every rank and none waits forever.
// Shared by the in-process transports (in_process.cpp: host memory moved on
// the issuing threads; stream_group.cpp: work on each rank's stream).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "zerocore/comm/comm.h"

namespace zerocore::comm_detail {

class Rendezvous {
 public:
  struct Arrival {
    CollectiveKey key;
    Tensor a, b;  // what the collective reads and writes (the same tensor where it is in place)
    int root = 0;
    std::string error;  // this rank's own argument check: "" when its arguments are right
  };

  explicit Rendezvous(int world);
  int world() const { return world_; }

  // Publishes `arrival` as `rank`'s, waits for every rank's and checks them
  // all: the same key, dtype and root on every rank, no rank's own error.
  // Throws CollectiveMismatch (naming every rank's key) or InvalidArgument
  // (the first rank's error) on every rank, after a second barrier, so
  // nobody republishes while another still reads. On return every rank's
  // arrival may be read until the caller's next barrier().
  void meet(int rank, Arrival arrival);
  const Arrival& arrival(int rank) const { return arrivals_[size_t(rank)]; }

  // Every rank waits for every other.
  void barrier();

 private:
  const int world_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::vector<Arrival> arrivals_;
};

}  // namespace zerocore::comm_detail
