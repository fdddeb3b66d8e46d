#include "process_backend.h"

#include <cstdlib>
#include <memory>
#include <string>

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

}  // namespace

CheckingCpuBackend* process_checker() {
  // Never destroyed: queues may outlive module teardown.
  static CheckingCpuBackend* const checker = checker_from_env().release();
  return checker;
}

Backend& process_backend() {
  CheckingCpuBackend* checker = process_checker();
  return checker ? static_cast<Backend&>(*checker) : default_cpu_backend();
}

}  // namespace zerocore::bindings
