#include "order_checker.h"

#include <algorithm>

#include "zerocore/error.h"

namespace zerocore {

void OrderChecker::add_buffer(const Buffer& buffer) {
  std::lock_guard<std::mutex> lock(mutex_);
  buffers_[reinterpret_cast<uintptr_t>(buffer.data())] = History{buffer.bytes(), buffer.name(), buffer.kind(), {}};
}

void OrderChecker::remove_buffer(const void* data) {
  std::lock_guard<std::mutex> lock(mutex_);
  buffers_.erase(reinterpret_cast<uintptr_t>(data));
}

std::vector<uint64_t>& OrderChecker::clock_of(int stream) {
  if (size_t(stream) >= clocks_.size()) clocks_.resize(size_t(stream) + 1);
  std::vector<uint64_t>& c = clocks_[size_t(stream)];
  if (size_t(stream) >= c.size()) c.resize(size_t(stream) + 1, 0);
  return c;
}

bool OrderChecker::ordered(const Record& r, int stream) {
  const std::vector<uint64_t>& c = clock_of(stream);
  return r.stream == stream || (size_t(r.stream) < c.size() && c[size_t(r.stream)] >= r.tick);
}

std::vector<int> OrderChecker::join_locked(int stream, const std::vector<uint64_t>& other) {
  std::vector<uint64_t>& c = clock_of(stream);
  if (c.size() < other.size()) c.resize(other.size(), 0);
  std::vector<int> grew;
  for (size_t i = 0; i < other.size(); ++i) {
    if (other[i] > c[i]) {
      c[i] = other[i];
      grew.push_back(int(i));
    }
  }
  return grew;
}

void OrderChecker::follow_host(int stream) {
  if (stream != kHostStream) join_locked(stream, std::vector<uint64_t>(clock_of(kHostStream)));
}

std::vector<uint64_t> OrderChecker::clock(int stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  follow_host(stream);  // a record is work the host gives the stream
  return clock_of(stream);
}

std::vector<int> OrderChecker::join(int stream, const std::vector<uint64_t>& other) {
  std::lock_guard<std::mutex> lock(mutex_);
  return join_locked(stream, other);
}

namespace {
std::string bytes_of(size_t begin, size_t end) {
  return "bytes [" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}
}  // namespace

std::string OrderChecker::describe(const History& h, const Record& first, const Record& second) const {
  auto says = [](const Record& r) {
    return "'" + r.op + "' on stream '" + r.stream_name + "' " + access_mode_name(r.mode) + "s " +
           bytes_of(r.begin, r.end);
  };
  const std::string waiter = second.stream == kHostStream ? "make the host wait (host_wait, not a stream wait)"
                                                           : "make stream '" + second.stream_name + "' wait";
  return "unordered accesses to buffer '" + h.name + "' (" + memory_kind_name(h.kind) + "): " + says(first) +
         ", then " + says(second) + " with no wait in between; " + waiter + " for an event recorded on stream '" +
         first.stream_name + "' after '" + first.op + "'";
}

std::vector<std::string> OrderChecker::access(int stream, const std::string& stream_name, const std::string& op,
                                              const std::vector<Access>& accesses) {
  std::lock_guard<std::mutex> lock(mutex_);
  follow_host(stream);
  const uint64_t tick = ++clock_of(stream)[size_t(stream)];
  std::vector<std::string> found;
  for (const Access& a : accesses) {
    if (a.bytes == 0) continue;
    const uintptr_t addr = reinterpret_cast<uintptr_t>(a.data);
    auto it = buffers_.upper_bound(addr);
    if (it == buffers_.begin()) continue;
    --it;
    History& h = it->second;
    const size_t begin = size_t(addr - it->first);
    if (begin >= h.bytes) continue;  // not in a backend buffer
    if (a.bytes > h.bytes - begin) {
      throw InvalidArgument("'" + op + "' on stream '" + stream_name + "' " + access_mode_name(a.mode) + "s " +
                            bytes_of(begin, begin + a.bytes) + " of buffer '" + h.name + "', which has " +
                            std::to_string(h.bytes) + " bytes");
    }
    const Record next{begin, begin + a.bytes, a.mode, stream, tick, stream_name, op};
    for (const Record& r : h.records) {
      const bool overlap = r.begin < next.end && next.begin < r.end;
      const bool writes = r.mode == AccessMode::kWrite || next.mode == AccessMode::kWrite;
      if (overlap && writes && !ordered(r, stream)) found.push_back(describe(h, r, next));
    }
    // Drop what `next` supersedes: a record it covers and follows, which a
    // later access cannot conflict with unless it conflicts with `next`
    // too (next writes, or both read on the same stream), and cannot follow
    // without following it too.
    h.records.erase(std::remove_if(h.records.begin(), h.records.end(),
                                   [&](const Record& r) {
                                     const bool covered = next.begin <= r.begin && r.end <= next.end;
                                     const bool subsumes = next.mode == AccessMode::kWrite ||
                                                           (r.mode == AccessMode::kRead && r.stream == stream);
                                     return covered && subsumes && ordered(r, stream);
                                   }),
                    h.records.end());
    h.records.push_back(next);
  }
  return found;
}

}  // namespace zerocore
