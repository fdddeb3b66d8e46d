// A zerocore::Transport over a Python object, so a CommQueue can run
// collectives that only Python can issue (torch.distributed process groups;
// zerocore.comm.process_group.ProcessGroupTransport) in its one native order,
// beside collectives native code issues on the same queue.
#pragma once
#include <nanobind/nanobind.h>

#include <memory>

#include "zerocore/comm/comm.h"

namespace zerocore::bindings {

// `impl` has `rank` and `world_size` (read once, here, with the GIL held)
// and the methods all_gather(key, shard, output), reduce_scatter(key, input,
// shard), all_reduce(key, tensor) and broadcast(key, tensor, root), where
// key is the collective's (kind, group, bucket, numel) and the tensors are
// DLPack objects (torch.from_dlpack views them) worked on in place. Each
// issues its collective and returns None if it is done, or else a callable
// that blocks until it is (the completion: called, once, on the queue's
// completing thread). The queue's threads take the GIL for each call;
// a Python exception fails the collective with a C++ error carrying its
// type and message (the queue's threads keep no Python exception once they let
// go of the GIL), which Event.wait() raises as RuntimeError; a TimeoutError
// with CollectiveTimeout, its message as is (the transport names the
// collective), raised as zerocore.CollectiveTimeoutError; an instance of
// the type given to register_rank_disagreement with RankDisagreement, raised
// as that type.
std::unique_ptr<Transport> python_transport(nanobind::object impl);

// The Python exception type (zerocore.RankDisagreementError) that a
// transport raises when ranks wait in different collectives: carried as
// RankDisagreement and raised again as itself by Event.wait().
void register_rank_disagreement(nanobind::handle type);

// A collective's key as Python sees it: (kind, group, bucket, numel).
nanobind::tuple key_tuple(const CollectiveKey& key);

}  // namespace zerocore::bindings
