#include <string>

#include "zerocore/comm/comm.h"

namespace zerocore {

namespace {

const char* kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
  }
  return "?";
}

// 1234567 -> "1,234,567"
std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return (n < 0 ? "-" : "") + out;
}

}  // namespace

std::string describe(const CollectiveKey& key) {
  const std::string size = " (" + with_commas(key.numel) + " elements)";
  if (key.group < 0) return std::string("control-plane ") + kind_name(key.kind) + size;
  return std::string(kind_name(key.kind)) + " of group " + std::to_string(key.group) + ", bucket " +
         std::to_string(key.bucket) + size;
}

}  // namespace zerocore
