// NcclLibrary's entry points, for the transport (internal to cuda/). Their
// types come from nccl.h, the one the build found (cmake/nccl.cmake); the
// library they point into is the one loaded at run time.
#pragma once
#include <nccl.h>

#include <string>

#include "zerocore/nccl_transport.h"

namespace zerocore {

class NcclLibrary {
 public:
  std::string path;
  int version = 0;
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclCommAbort) comm_abort = nullptr;
  decltype(&ncclCommGetAsyncError) comm_get_async_error = nullptr;
  decltype(&ncclGetErrorString) get_error_string = nullptr;
  decltype(&ncclGetLastError) get_last_error = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclReduceScatter) reduce_scatter = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;

  // "what: <NCCL's error string> (<its last error message>)" for a failed
  // call's result; `comm` may be null (before a communicator exists).
  std::string error(const char* what, ncclResult_t result, ncclComm_t comm) const;
  // Throws std::runtime_error(error(...)) unless `result` is ncclSuccess.
  void check(ncclResult_t result, const char* what, ncclComm_t comm) const;
};

}  // namespace zerocore
