#include "process_backend.h"

#include <cstdlib>
#include <memory>
#include <string>

#include "zerocore/backend/checking_backend.h"
#include "zerocore/error.h"

namespace zerocore::bindings {

namespace {

std::unique_ptr<CheckingCpuBackend> checker_from_env() {
  const char* value = std::getenv("ZEROCORE_BACKEND");
  const std::string v = value ? value : "";
  if (v.empty() || v == "cpu") return nullptr;
  const std::string prefix = "checking";
  if (v.compare(0, prefix.size(), prefix) == 0) {
    CheckingOptions options;
    if (v.size() > prefix.size()) {
      const std::string seed = v.substr(prefix.size() + 1);
      char* end = nullptr;
      options.seed = std::strtoull(seed.c_str(), &end, 10);
      if (v[prefix.size()] != ':' || seed.empty() || *end != '\0') {
        throw InvalidArgument("ZEROCORE_BACKEND='" + v + "': write checking:<seed> with a non-negative integer seed");
      }
    }
    return std::make_unique<CheckingCpuBackend>(options);
  }
  throw InvalidArgument("ZEROCORE_BACKEND='" + v + "': set it to cpu, checking or checking:<seed>, or leave it unset");
}

BoundBackend* from_env() {
  if (std::unique_ptr<CheckingCpuBackend> checker = checker_from_env()) {
    return new HeldBackend<CheckingCpuBackend>(std::move(checker));
  }
  return new HeldBackend<CpuBackend>(default_cpu_backend());
}

}  // namespace

BoundBackend& process_backend() {
  static BoundBackend* const backend = from_env();  // never destroyed
  return *backend;
}

}  // namespace zerocore::bindings
