// A Transport (comm/comm.h) that calls NCCL directly, from the comm queue's
// own threads: no Python and no GIL on the data plane's path.
//
// - The library: libnccl.so.2, loaded at run time (dlopen) from a path the
//   caller chooses (zerocore.comm.nccl: ZEROCORE_NCCL_LIBRARY, else the
//   nvidia-nccl pip package's, else the loader's search). Nothing links
//   against NCCL, so zerocore loads where NCCL is absent; only asking for
//   this transport fails there, naming the path tried.
// - The communicator: its own (ncclCommInitRank), from a unique id that
//   rank 0 makes (nccl_unique_id) and the caller hands to every rank (the
//   Python side through torch.distributed's store).
// - Collectives: each issued on the queue's comm stream (issue_on), with
//   the device made current on the issuing thread first, so NCCL works on
//   the stream's device by construction. The completion it returns is run
//   by the queue's completing thread: it polls an event recorded after the
//   collective and NCCL's asynchronous error; past the timeout it aborts
//   the communicator and throws CollectiveTimeout. See nccl_transport.cpp
//   for why the watching happens there.
#pragma once
#include <memory>
#include <string>

#include "zerocore/comm/comm.h"

namespace zerocore {

// A loaded libnccl: its entry points (opaque here, so that no caller needs
// nccl.h).
class NcclLibrary;

// Loads NCCL from `path` ("" = "libnccl.so.2" through the loader's search),
// once per path in a process (the handle is never closed: NCCL does not
// support being unloaded). A missing library, a missing entry point or an
// NCCL of another major version throws std::runtime_error naming the path
// and the fallback (Config(nccl="torch")).
std::shared_ptr<const NcclLibrary> load_nccl(const std::string& path);

// The path the library was loaded from, as given ("" for the default).
const std::string& nccl_path(const NcclLibrary& nccl);
// ncclGetVersion's code (e.g. 23203 for 2.32.3).
int nccl_version(const NcclLibrary& nccl);
// A new ncclUniqueId's bytes (ncclGetUniqueId): rank 0 makes it, every rank
// of the communicator is given it.
std::string nccl_unique_id(const NcclLibrary& nccl);

class NcclTransport : public Transport {
 public:
  // The cudaStream_t its collectives go on from now on (the comm queue's),
  // set once, before the first collective.
  virtual void issue_on(void* stream) = 0;
};

struct NcclTransportOptions {
  int rank = 0;
  int world_size = 1;
  int device = 0;                 // the CUDA device of the queue's backend
  double timeout_seconds = 1800;  // a collective's wait for its peers
};

// This rank's member of the communicator of `unique_id` (nccl_unique_id's
// bytes): ncclCommInitRank, which returns once every rank joined.
std::unique_ptr<NcclTransport> nccl_transport(std::shared_ptr<const NcclLibrary> nccl, const std::string& unique_id,
                                              const NcclTransportOptions& options);

}  // namespace zerocore
