#include "rendezvous.h"

#include "zerocore/error.h"

namespace zerocore::comm_detail {

Rendezvous::Rendezvous(int world) : world_(world), arrivals_(size_t(world)) {}

void Rendezvous::barrier() {
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t gen = generation_;
  if (++arrived_ == world_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
  } else {
    cv_.wait(lock, [&] { return generation_ != gen; });
  }
}

void Rendezvous::meet(int rank, Arrival arrival) {
  if (!arrival.error.empty()) {
    arrival.error = "rank " + std::to_string(rank) + ": " + describe(arrival.key) + ": " + arrival.error;
  }
  arrivals_[size_t(rank)] = std::move(arrival);
  barrier();
  const Arrival& first = arrivals_[0];
  std::string mismatch;
  for (const Arrival& a : arrivals_) {
    if (a.key != first.key || a.a.dtype() != first.a.dtype() || a.root != first.root) {
      mismatch = "ranks issued different collectives:";
      break;
    }
  }
  if (!mismatch.empty()) {
    for (int q = 0; q < world_; ++q) mismatch += "\n  rank " + std::to_string(q) + ": " + describe(arrivals_[size_t(q)].key);
  }
  std::string failure;
  for (const Arrival& a : arrivals_) {
    if (!a.error.empty()) {
      failure = a.error;
      break;
    }
  }
  if (mismatch.empty() && failure.empty()) return;
  barrier();  // everyone has read the published state before anyone republishes
  if (!mismatch.empty()) throw CollectiveMismatch(mismatch);
  throw InvalidArgument(failure);
}

}  // namespace zerocore::comm_detail
