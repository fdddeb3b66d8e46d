// zerocore._native.NcclLibrary: the native NCCL transport's library and the
// comm queues over it (only in a build with the transport: cmake/nccl.cmake).
// The bootstrap (the unique id through torch.distributed's store) and the
// choice of transport are Python's: zerocore/comm/nccl.py.
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <memory>
#include <string>
#include <utility>

#include "bindings.h"
#include "bound_backend.h"
#include "bound_queue.h"
#include "zerocore/cuda_backend.h"
#include "zerocore/error.h"
#include "zerocore/nccl_transport.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace zerocore::bindings {

namespace {

struct BoundNccl {
  std::shared_ptr<const NcclLibrary> library;
};

// A queue whose transport is a new member of the communicator of
// `unique_id`, issuing on the queue's comm stream, a stream of `backend`.
std::unique_ptr<BoundQueue> nccl_queue(const BoundNccl& nccl, nb::bytes unique_id, int rank, int world_size,
                                       BoundBackend& backend, double timeout_seconds) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend.get());
  if (!cuda) throw InvalidArgument("NcclLibrary.queue: the native NCCL transport runs on a CudaBackend");
  const NcclTransportOptions options{rank, world_size, cuda->device(), timeout_seconds};
  const std::string id(unique_id.c_str(), unique_id.size());
  std::unique_ptr<NcclTransport> transport;
  {
    nb::gil_scoped_release released;  // ncclCommInitRank waits for every rank
    transport = nccl_transport(nccl.library, id, options);
  }
  NcclTransport& issuing = *transport;
  auto queue = std::make_unique<BoundQueue>(std::move(transport), nb::find(backend), StreamPlane::kDevice);
  issuing.issue_on(cuda->handle(queue->get().stream()));  // before anything is issued on it
  return queue;
}

}  // namespace

void bind_nccl(nb::module_& m) {
  nb::class_<BoundNccl>(m, "NcclLibrary", "libnccl, loaded at run time (dlopen): the native NCCL transport's.")
      .def(
          "__init__", [](BoundNccl* self, const std::string& path) { new (self) BoundNccl{load_nccl(path)}; },
          "path"_a,
          "Loads NCCL from `path` (\"\": libnccl.so.2 through the loader's search), once per path; RuntimeError "
          "naming the path when it is missing, not NCCL, or of another major version than the build's nccl.h.")
      .def_prop_ro("path", [](const BoundNccl& n) { return nccl_path(*n.library); })
      .def_prop_ro("version", [](const BoundNccl& n) { return nccl_version(*n.library); },
                   "ncclGetVersion's code (e.g. 23203 for 2.32.3).")
      .def(
          "unique_id",
          [](const BoundNccl& n) {
            const std::string id = nccl_unique_id(*n.library);
            return nb::bytes(id.data(), id.size());
          },
          "A new ncclUniqueId's bytes (rank 0's, for every rank of a communicator).")
      .def("queue", &nccl_queue, "unique_id"_a, "rank"_a, "world_size"_a, "backend"_a, "timeout_seconds"_a,
           "A CommQueue over this rank's member of the communicator of `unique_id` (ncclCommInitRank: returns once "
           "every rank joined), its comm stream a stream of `backend` (a CudaBackend), where its collectives go. "
           "A collective not done within timeout_seconds aborts the communicator and raises "
           "CollectiveTimeoutError naming it.");
}

}  // namespace zerocore::bindings
