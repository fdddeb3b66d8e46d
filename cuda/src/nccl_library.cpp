// Loading libnccl at run time: dlopen once per path, every entry point the
// transport uses looked up by name, and the version checked against the
// header the build used (nccl.h's types and enum values are the ABI).
#include "nccl_library.h"

#include <dlfcn.h>

#include <map>
#include <mutex>
#include <stdexcept>

namespace zerocore {

namespace {

// The fallback every loading error names.
constexpr const char* kFallback =
    "Set ZEROCORE_NCCL_LIBRARY to the path of a libnccl.so.2, install nvidia-nccl-cu13, or train on "
    "torch.distributed's NCCL with zerocore.Config(nccl=\"torch\")";

std::string shown(const std::string& path) { return path.empty() ? "libnccl.so.2 (the loader's search)" : path; }

template <class Fn>
void look_up(void* handle, const std::string& path, const char* name, Fn& fn) {
  fn = reinterpret_cast<Fn>(dlsym(handle, name));
  if (!fn) {
    throw std::runtime_error("zerocore: " + shown(path) + " has no " + name +
                             ", so it is not an NCCL library zerocore can use. " + kFallback);
  }
}

std::shared_ptr<const NcclLibrary> open_nccl(const std::string& path) {
  const std::string file = path.empty() ? "libnccl.so.2" : path;
  // RTLD_LOCAL: NCCL's symbols stay out of the global namespace, where
  // torch's own libnccl may live.
  void* handle = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* why = dlerror();
    throw std::runtime_error("zerocore: cannot load NCCL from " + shown(path) + ": " + (why ? why : "dlopen failed") +
                             ". " + kFallback);
  }
  auto nccl = std::make_shared<NcclLibrary>();
  nccl->path = path;
  look_up(handle, path, "ncclGetVersion", nccl->get_version);
  look_up(handle, path, "ncclGetUniqueId", nccl->get_unique_id);
  look_up(handle, path, "ncclCommInitRank", nccl->comm_init_rank);
  look_up(handle, path, "ncclCommDestroy", nccl->comm_destroy);
  look_up(handle, path, "ncclCommAbort", nccl->comm_abort);
  look_up(handle, path, "ncclCommGetAsyncError", nccl->comm_get_async_error);
  look_up(handle, path, "ncclGetErrorString", nccl->get_error_string);
  look_up(handle, path, "ncclGetLastError", nccl->get_last_error);
  look_up(handle, path, "ncclAllGather", nccl->all_gather);
  look_up(handle, path, "ncclReduceScatter", nccl->reduce_scatter);
  look_up(handle, path, "ncclAllReduce", nccl->all_reduce);
  look_up(handle, path, "ncclBroadcast", nccl->broadcast);
  nccl->check(nccl->get_version(&nccl->version), "ncclGetVersion", nullptr);
  if (nccl->version / 10000 != NCCL_MAJOR) {
    throw std::runtime_error("zerocore: " + shown(path) + " is NCCL " + std::to_string(nccl->version) +
                             ", but zerocore was built against NCCL " + std::to_string(NCCL_VERSION_CODE) +
                             " (another major version). " + kFallback);
  }
  return nccl;
}

}  // namespace

std::string NcclLibrary::error(const char* what, ncclResult_t result, ncclComm_t comm) const {
  std::string text = std::string(what) + ": " + get_error_string(result);
  const char* last = get_last_error(comm);
  if (last && *last) text += " (" + std::string(last) + ")";
  return text;
}

void NcclLibrary::check(ncclResult_t result, const char* what, ncclComm_t comm) const {
  if (result != ncclSuccess) throw std::runtime_error("zerocore: " + error(what, result, comm));
}

std::shared_ptr<const NcclLibrary> load_nccl(const std::string& path) {
  // A failed load is not cached: the caller may fix the environment and ask again.
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<const NcclLibrary>> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  std::shared_ptr<const NcclLibrary>& nccl = loaded[path];
  if (!nccl) nccl = open_nccl(path);
  return nccl;
}

const std::string& nccl_path(const NcclLibrary& nccl) { return nccl.path; }

int nccl_version(const NcclLibrary& nccl) { return nccl.version; }

std::string nccl_unique_id(const NcclLibrary& nccl) {
  ncclUniqueId id;
  nccl.check(nccl.get_unique_id(&id), "ncclGetUniqueId", nullptr);
  return std::string(id.internal, sizeof(id.internal));
}

}  // namespace zerocore
