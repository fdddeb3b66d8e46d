#include "device_table.h"

#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "cuda_check.h"

namespace zerocore::cuda_detail {

const void* device_table(int device, const void* host, size_t bytes) {
  static std::mutex mutex;
  // Keyed by contents: equal bytes are an equal table, whatever kernel reads it.
  static std::map<std::pair<int, std::string>, void*> tables;
  std::pair<int, std::string> key{device, std::string(static_cast<const char*>(host), bytes)};
  std::lock_guard<std::mutex> lock(mutex);
  auto it = tables.find(key);
  if (it != tables.end()) return it->second;
  // On `device`, whatever the calling thread's current device is.
  DeviceGuard guard(device);
  void* table = nullptr;
  check(cudaMalloc(&table, bytes), "cudaMalloc(device table)");
  check(cudaMemcpy(table, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy(device table)");
  tables.emplace(std::move(key), table);
  return table;
}

}  // namespace zerocore::cuda_detail
