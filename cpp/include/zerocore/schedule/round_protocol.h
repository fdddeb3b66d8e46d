// Stage 3's rounds, as a wire protocol: what a rank posts, how it is
// summed and waited for, and what the sums say. The unit schedule decides
// what the sums mean (which gathers, prefetches and reductions follow);
// this class only carries them, so that the layout of the control buffer
// and the bookkeeping of the round in flight live in one place and the
// schedule reads named counts instead of offsets.
//
// A round is one all-reduce of a small float buffer over the rounds' own
// queue (a communicator of the same ranks as the data, so that a round
// never waits behind the gathers and reductions queued before it). Per
// unit each rank posts five 0/1 flags, summed into counts of ranks: it
// needs the unit now (it is not gathered here), is at it, has it gathered,
// still expects its backward, produced grads for it. Then the pass-wide
// ones: done (its pass ended), failed (its pass raised), in backward; and
// its free pool slots as a one-hot over 0..planned, so that the sums say
// the fewest free slots any rank has. A round is posted without waiting
// and settled later (the next hook), so its all-reduce travels while the
// unit computes; only one is in flight at a time. At world size 1 there is
// nothing to agree on: a rank's flags are the sums, nothing is issued or
// waited for (so the host never waits for the device at a hook, and the
// host runs ahead of the GPU), and no round is counted.
#pragma once
#include <functional>
#include <memory>
#include <stdexcept>
#include <vector>

#include "zerocore/comm/comm.h"
#include "zerocore/tensor.h"

namespace zerocore {

// Another rank reported a failure in a round (its forward or backward
// raised); thrown on every other rank at the same round, so none waits.
class PeerFailed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class RoundProtocol {
 public:
  // What this rank says about one unit.
  struct UnitReport {
    bool has = false;      // gathered here
    bool expects = false;  // a post-backward point of it is still to come, or its grads are open to the end
    bool ran = false;      // it produces grads in this backward
  };
  // What this rank says about itself.
  struct RankReport {
    int need = -1;       // the unit its hook needs and does not have, or -1
    int at = -1;         // the unit its hook is at, or -1
    bool done = false;   // its pass ended
    bool failed = false; // its pass raised
    bool backward = false;
    int free_slots = 0;  // free pool slots by the time the round settles (capped at the planned ones)
    bool blocking = false;  // this rank waits for the round at once: counted in blocking_rounds()
  };
  // A round's result: every rank's flags, summed over the ranks. A view of
  // the control buffer, valid until the next post. Default: no round.
  class Sums {
   public:
    Sums() = default;
    Sums(const float* flags, int units, int max_free, int world, bool failed_here);
    explicit operator bool() const { return flags_ != nullptr; }
    // Per unit, how many ranks said so.
    float need(int unit) const { return count(unit, kNeed); }
    float at(int unit) const { return count(unit, kAt); }
    float has(int unit) const { return count(unit, kHas); }
    float expects(int unit) const { return count(unit, kExpects); }
    float ran(int unit) const { return count(unit, kRan); }
    bool all_have(int unit) const { return has(unit) >= world_; }
    bool all_done() const { return done_ >= world_; }  // every rank's pass ended
    float failed = 0;            // ranks whose pass raised
    bool failed_here = false;    // this rank posted failed
    bool backward = false;       // every rank posted it in backward
    int min_free = 0;            // the fewest free pool slots any rank had

   private:
    enum Flag { kNeed, kAt, kHas, kExpects, kRan };
    float count(int unit, Flag f) const;
    const float* flags_ = nullptr;
    float done_ = 0, world_ = 1;
  };

  // A protocol for `units` units and a pool planned with `planned_slots`.
  RoundProtocol(CommQueue& rounds, int units, int planned_slots);
  ~RoundProtocol();  // waits for the round in flight
  RoundProtocol(const RoundProtocol&) = delete;
  RoundProtocol& operator=(const RoundProtocol&) = delete;

  // Posts this rank's round: `self`, and `unit(u)` for every unit. Throws
  // std::logic_error while a round is in flight (settle it first).
  void post(const RankReport& self, const std::function<UnitReport(int)>& unit);
  // Waits for the round in flight and gives its sums; no round when none is in flight.
  Sums settle();

  // The round carried by another exchange (the step's, ZeroStep), which
  // sums the same flags: flags() writes this rank's, adopt() takes their
  // sums over the ranks and counts the round.
  std::vector<float> flags(const RankReport& self, const std::function<UnitReport(int)>& unit);
  Sums adopt(const std::vector<float>& summed);
  int64_t width() const { return buffer_.numel(); }  // floats in a round

  // Rounds since construction; those a rank waited for at once; seconds
  // spent waiting for rounds' all-reduces.
  int64_t rounds() const { return rounds_; }
  int64_t blocking_rounds() const { return blocking_rounds_; }
  double round_seconds() const { return round_seconds_; }

 private:
  static constexpr int kUnitFlags = 5;  // Sums::Flag
  static constexpr int kGlobals = 3;    // done, failed, backward; then the one-hot of free slots
  void fill(const RankReport& self, const std::function<UnitReport(int)>& unit);
  Sums sums(bool failed_here) const;

  CommQueue& queue_;
  // The queue's backend and world, kept: the protocol may outlive its queue
  // (waiting for nothing then), never its backend.
  Backend& backend_;
  int world_ = 1;
  int units_ = 0;
  int planned_slots_ = 0;
  Tensor buffer_;  // the control buffer: a host vector, not an arena of the plan
  bool posted_ = false;                         // a round is posted and not settled
  std::shared_ptr<StreamEvent> posted_event_;  // its all-reduce's completion (none at world size 1)
  bool posted_failed_ = false;
  int64_t rounds_ = 0, blocking_rounds_ = 0;
  double round_seconds_ = 0;
};

}  // namespace zerocore
