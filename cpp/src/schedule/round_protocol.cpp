#include "zerocore/schedule/round_protocol.h"

#include <algorithm>
#include <chrono>

#include "zerocore/comm/control_key.h"

namespace zerocore {

RoundProtocol::Sums::Sums(const float* flags, int units, int max_free, int world, bool failed_here)
    : failed_here(failed_here), flags_(flags), world_(float(world)) {
  const float* global = flags + size_t(units) * kUnitFlags;
  done_ = global[0];
  failed = global[1];
  backward = global[2] >= world_;
  while (min_free < max_free && global[kGlobals + min_free] == 0) ++min_free;
}

float RoundProtocol::Sums::count(int unit, Flag f) const { return flags_[size_t(unit) * kUnitFlags + f]; }

RoundProtocol::RoundProtocol(CommQueue& rounds, int units, int planned_slots)
    : queue_(rounds),
      backend_(rounds.backend()),
      world_(rounds.world_size()),
      units_(units),
      planned_slots_(planned_slots) {
  auto flags = std::make_shared<std::vector<float>>(size_t(units) * kUnitFlags + kGlobals + size_t(planned_slots) + 1);
  buffer_ = Tensor(flags->data(), DType::kFloat32, Device{}, {int64_t(flags->size())}, flags);
}

RoundProtocol::~RoundProtocol() {
  if (!posted_event_) return;
  try {
    backend_.host_wait(*posted_event_);
  } catch (...) {  // the queue's error was raised to whoever waited first
  }
}

void RoundProtocol::fill(const RankReport& self, const std::function<UnitReport(int)>& unit) {
  if (posted_) {
    throw std::logic_error("RoundProtocol: a round is written while the last one is in flight (settle it first)");
  }
  float* flags = buffer_.data_as<float>();
  for (int u = 0; u < units_; ++u) {
    const UnitReport r = unit(u);
    float* f = flags + size_t(u) * kUnitFlags;
    f[0] = u == self.need ? 1.0f : 0.0f;
    f[1] = u == self.at ? 1.0f : 0.0f;
    f[2] = r.has ? 1.0f : 0.0f;
    f[3] = r.expects ? 1.0f : 0.0f;
    f[4] = r.ran ? 1.0f : 0.0f;
  }
  float* global = flags + size_t(units_) * kUnitFlags;
  std::fill(global, global + kGlobals + planned_slots_ + 1, 0.0f);
  global[0] = self.done ? 1.0f : 0.0f;
  global[1] = self.failed ? 1.0f : 0.0f;
  global[2] = self.backward ? 1.0f : 0.0f;
  global[kGlobals + std::min(self.free_slots, planned_slots_)] = 1.0f;
}

void RoundProtocol::post(const RankReport& self, const std::function<UnitReport(int)>& unit) {
  fill(self, unit);
  posted_ = true;
  posted_failed_ = self.failed;
  if (world_ == 1) return;  // one rank: its flags are the sums
  posted_event_ =
      queue_.all_reduce(control_key(CollectiveKind::kAllReduce, ControlPurpose::kRound, buffer_.numel()), buffer_);
  ++rounds_;
  if (self.blocking) ++blocking_rounds_;
}

RoundProtocol::Sums RoundProtocol::settle() {
  if (!posted_) return Sums{};
  posted_ = false;
  if (posted_event_) {
    const auto start = std::chrono::steady_clock::now();
    const std::shared_ptr<StreamEvent> posted = std::move(posted_event_);
    backend_.host_wait(*posted);
    round_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return sums(posted_failed_);
}

std::vector<float> RoundProtocol::flags(const RankReport& self, const std::function<UnitReport(int)>& unit) {
  fill(self, unit);
  const float* flags = buffer_.data_as<float>();
  return std::vector<float>(flags, flags + buffer_.numel());
}

RoundProtocol::Sums RoundProtocol::adopt(const std::vector<float>& summed) {
  std::copy(summed.begin(), summed.end(), buffer_.data_as<float>());
  if (world_ > 1) ++rounds_;
  return sums(false);
}

RoundProtocol::Sums RoundProtocol::sums(bool failed_here) const {
  return Sums(buffer_.data_as<float>(), units_, planned_slots_, world_, failed_here);
}

}  // namespace zerocore
