// zerocore._native.CommQueue, Event and CollectiveKey: the engine issues
// every collective on one native ordered queue per process group (see
// comm.h), over a Python transport or the single-process group, so native
// code can issue on the same queue.
//
// The GIL: the queue's threads take it to run a Python transport (issue a
// collective, wait for its completion) and to let go of the torch tensors a
// collective held. So no thread that holds the GIL may wait for the queue:
// Event.wait() releases it while waiting, and a queue is closed (drained,
// its threads joined) with the GIL released.
#include <nanobind/stl/array.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "bound_queue.h"
#include "dlpack_tensor.h"
#include "python_transport.h"
#include "zerocore/comm/comm.h"
#include "zerocore/comm/control_key.h"
#include "zerocore/error.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace zerocore::bindings {

namespace {

CollectiveKey make_key(int64_t kind, int64_t group, int64_t bucket, int64_t numel) {
  if (kind < 0 || kind > int64_t(CollectiveKind::kBroadcast)) {
    throw InvalidArgument("collective key: kind must be 0 (all_gather), 1 (reduce_scatter), 2 (all_reduce) or "
                          "3 (broadcast), got " + std::to_string(kind));
  }
  return CollectiveKey{CollectiveKind(kind), int32_t(group), int32_t(bucket), numel};
}

CollectiveKey to_key(nb::handle key) {
  if (nb::isinstance<CollectiveKey>(key)) return nb::cast<CollectiveKey>(key);
  std::vector<int64_t> fields;
  if (!nb::try_cast(key, fields) || fields.size() != 4) {
    throw TypeMismatch(std::string("collective key must be a CollectiveKey or a tuple (kind, group, bucket, numel) "
                                   "of ints, got ") + nb::repr(key).c_str());
  }
  return make_key(fields[0], fields[1], fields[2], fields[3]);
}

// CollectiveTimeout as Python sees it: a RuntimeError, as torch's own
// collective errors, and a TimeoutError. The module holds the type.
void bind_collective_timeout(nb::module_& m) {
  nb::object bases = nb::make_tuple(nb::handle(PyExc_RuntimeError), nb::handle(PyExc_TimeoutError));
  static PyObject* type = PyErr_NewExceptionWithDoc(
      "zerocore._native.CollectiveTimeoutError",
      "A collective did not complete within its process group's timeout: a peer is stuck or dead. Raised on every "
      "live rank; the message names the collective, and every later collective of the engine fails with it.",
      bases.ptr(), nullptr);
  if (!type) throw nb::python_error();
  m.attr("CollectiveTimeoutError") = nb::borrow(type);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const CollectiveTimeout& e) {
      PyErr_SetString(type, e.what());
    }
  });
}

// A collective's completion as Python holds it: the queue's backend event,
// waited for through that backend, which it keeps alive.
struct CollectiveEvent {
  nb::object owner;  // the bound backend
  Backend* backend;
  std::shared_ptr<StreamEvent> event;
};

CollectiveEvent completion(const BoundQueue& q, std::shared_ptr<StreamEvent> event) {
  return CollectiveEvent{q.backend(), &q.get().backend(), std::move(event)};
}

// The queue, its comm stream ordered after everything the compute stream
// did so far: a collective Python issues reads and writes torch tensors the
// host's work produced (a partition the offload update wrote and the host
// waited for, a buffer filled by torch), as torch.distributed's NCCL backend
// waits for the current stream. The native schedules issue theirs directly,
// each behind the waits it needs.
CommQueue& behind_compute(const BoundQueue& bound) {
  CommQueue& q = bound.get();
  Backend& backend = q.backend();
  backend.wait(q.stream(), *backend.record(backend.compute_stream()));
  return q;
}

// `transport`, completing late where the environment asks
// (ZEROCORE_LATE_COMPLETION: a test switch, see comm.h).
std::unique_ptr<Transport> late_if_asked(std::unique_ptr<Transport> transport) {
  const std::optional<LateCompletion> late = late_completion_from_env();
  return late ? completing_late(std::move(transport), *late) : std::move(transport);
}

}  // namespace

void bind_comm(nb::module_& m) {
  bind_collective_timeout(m);
  m.def("register_rank_disagreement", &register_rank_disagreement, "type"_a,
        "The exception type (zerocore.RankDisagreementError) a Python transport raises when ranks wait in different "
        "collectives; it comes out of Event.wait() as itself (its message), not as a RuntimeError.");
  // An IntEnum: a key's kind as Python holds it in a tuple, in a trace or in
  // the queue's stats (indexed by it), is the native value.
  nb::enum_<CollectiveKind>(m, "CollectiveKind", nb::is_arithmetic(),
                            "What a collective does (comm.h); the first three are the data plane's.")
      .value("ALL_GATHER", CollectiveKind::kAllGather)
      .value("REDUCE_SCATTER", CollectiveKind::kReduceScatter)
      .value("ALL_REDUCE", CollectiveKind::kAllReduce)
      .value("BROADCAST", CollectiveKind::kBroadcast);
  nb::enum_<ControlPurpose>(m, "ControlPurpose", nb::is_arithmetic(),
                            "What a control-plane collective is for: its key's bucket (control_key.h).")
      .value("ROUND", ControlPurpose::kRound)
      .value("NORMS", ControlPurpose::kNorms)
      .value("AGREEMENT", ControlPurpose::kAgreement)
      .value("BROADCASTS", ControlPurpose::kBroadcasts)
      .value("MICRO_BATCHES", ControlPurpose::kMicroBatches)
      .value("EXACT_GRADS", ControlPurpose::kExactGrads);
  m.attr("CONTROL_GROUP") = kControlGroup;
  nb::class_<CollectiveKey>(m, "CollectiveKey",
                            "What a collective moves: kind (0 all_gather, 1 reduce_scatter, 2 all_reduce, "
                            "3 broadcast), flat group (negative: control plane), bucket, elements.")
      .def("__init__",
           [](CollectiveKey* self, int64_t kind, int64_t group, int64_t bucket, int64_t numel) {
             new (self) CollectiveKey(make_key(kind, group, bucket, numel));
           },
           "kind"_a, "group"_a, "bucket"_a, "numel"_a)
      .def_prop_ro("kind", [](const CollectiveKey& k) { return int(k.kind); })
      .def_ro("group", &CollectiveKey::group)
      .def_ro("bucket", &CollectiveKey::bucket)
      .def_ro("numel", &CollectiveKey::numel)
      .def("__repr__", [](const CollectiveKey& k) { return "CollectiveKey(" + describe(k) + ")"; });

  nb::class_<CollectiveEvent>(m, "Event", "Completion of one queued collective.")
      .def(
          "wait", [](const CollectiveEvent& e) { e.backend->host_wait(*e.event); },
          nb::call_guard<nb::gil_scoped_release>(),
          "Blocks (without the GIL) until the collective completed (its data moved); raises its error if it "
          "failed.")
      .def(
          "compute_waits",
          [](const CollectiveEvent& e) { e.backend->wait(e.backend->compute_stream(), *e.event); },
          nb::call_guard<nb::gil_scoped_release>(),
          "The compute stream waits for the collective, for a reader on it (torch's work): on CUDA on the device, "
          "the host going on; on the CPU the caller, who is the compute stream, waits here. Raises its error if "
          "it failed.")
      .def(
          "ready", [](const CollectiveEvent& e) { return e.backend->query(*e.event); },
          "True once the collective completed (or failed).");

  nb::class_<BoundQueue>(m, "CommQueue",
                         "A group's comm stream: native threads issuing and completing its collectives in issue order "
                         "(comm.h). Tensors are DLPack objects (torch tensors), kept alive until their collective "
                         "completed; each issue returns the Event of its completion, which must be waited for before "
                         "the output is read or the input reused.")
      .def("__init__",
           [](BoundQueue* self, nb::object transport, BoundBackend& backend, StreamPlane plane) {
             new (self) BoundQueue(late_if_asked(python_transport(std::move(transport))), nb::find(backend), plane);
           },
           "transport"_a, "backend"_a, "plane"_a = StreamPlane::kDevice,
           "A queue over a Python transport, its comm stream a new stream of `backend` (a "
           "zerocore._native.Backend, which the queue keeps alive) of `plane` (StreamPlane.CONTROL for the "
           "control plane's agreements and rounds). The transport is an object with rank, "
           "world_size and the methods "
           "all_gather(key, shard, output), reduce_scatter(key, input, shard), all_reduce(key, tensor), "
           "broadcast(key, tensor, root), called on the queue's thread with the key (kind, group, bucket, numel) and "
           "DLPack tensors; each issues its collective and returns None once it is done, or else a callable that "
           "blocks until it is, which the queue's completing thread calls. A TimeoutError they raise comes out of Event.wait() as CollectiveTimeoutError, with its "
           "message as is; any other error as RuntimeError naming the collective.")
      .def_static(
          "single_process",
          [](BoundBackend& backend, StreamPlane plane) { return std::make_unique<BoundQueue>(nb::find(backend), plane); },
          "backend"_a, "plane"_a = StreamPlane::kDevice,
          "A queue of this rank alone (no torch.distributed, or a group of one), on `backend`: each collective is "
          "a copy on its comm stream (or nothing), issued by the caller, with no transport or thread.")
      .def_prop_ro("backend", &BoundQueue::backend, "The backend the queue's comm stream is a stream of.")
      .def_prop_ro(
          "stream", [](const BoundQueue& q) -> Stream& { return q.get().stream(); }, nb::rv_policy::reference_internal,
          "The queue's comm stream (a stream of its backend; on CUDA, Backend.stream_handle gives its cudaStream_t).")
      .def_prop_ro("rank", [](const BoundQueue& q) { return q.get().rank(); })
      .def_prop_ro("world_size", [](const BoundQueue& q) { return q.get().world_size(); })
      .def(
          "all_gather",
          [](const BoundQueue& q, nb::handle key, nb::handle shard, nb::handle output, bool counted,
             bool after_compute) {
            CommQueue& queue = after_compute ? behind_compute(q) : q.get();
            return completion(q, queue.all_gather(to_key(key), tensor_from_dlpack(shard, "shard"),
                                                  tensor_from_dlpack(output, "output"), counted));
          },
          "key"_a, "shard"_a, "output"_a, "counted"_a = true, "after_compute"_a = true,
          "output (world_size x shard) <- every rank's shard. after_compute=False: shard is host memory the host "
          "wrote, which no device work must precede, so the comm stream does not wait for the compute stream.")
      .def(
          "reduce_scatter",
          [](const BoundQueue& q, nb::handle key, nb::handle input, nb::handle shard, bool counted) {
            return completion(q, behind_compute(q).reduce_scatter(to_key(key), tensor_from_dlpack(input, "input"),
                                                                  tensor_from_dlpack(shard, "shard"), counted));
          },
          "key"_a, "input"_a, "shard"_a, "counted"_a = true,
          "shard <- this rank's block of the sum of every rank's input.")
      .def(
          "all_reduce",
          [](const BoundQueue& q, nb::handle key, nb::handle tensor, bool counted) {
            return completion(q,
                              behind_compute(q).all_reduce(to_key(key), tensor_from_dlpack(tensor, "tensor"), counted));
          },
          "key"_a, "tensor"_a, "counted"_a = true, "tensor <- the sum of every rank's tensor.")
      .def(
          "broadcast",
          [](const BoundQueue& q, nb::handle key, nb::handle tensor, int root, bool counted) {
            return completion(q, behind_compute(q).broadcast(to_key(key), tensor_from_dlpack(tensor, "tensor"),
                                                             root, counted));
          },
          "key"_a, "tensor"_a, "root"_a, "counted"_a = true, "tensor <- rank root's tensor.")
      .def_prop_ro("fingerprint", [](const BoundQueue& q) { return q.get().fingerprint(); },
                   "64-bit hash of the data-plane keys issued since the last restart_trace().")
      .def(
          "trace",
          [](const BoundQueue& q) {
            nb::list out;
            for (const CollectiveKey& k : q.get().trace()) out.append(key_tuple(k));
            return out;
          },
          "The first trace_limit data-plane keys since the last restart_trace(), as (kind, group, bucket, numel).")
      .def("restart_trace", [](const BoundQueue& q) { q.get().restart_trace(); },
           "Fingerprint and trace back to their start.")
      .def_prop_rw(
          "trace_limit", [](const BoundQueue& q) { return q.get().trace_limit(); },
          [](const BoundQueue& q, size_t limit) { q.get().set_trace_limit(limit); },
          "The most keys the trace keeps (the fingerprint covers them all).")
      .def("stats", [](const BoundQueue& q) { return q.get().stats(); },
           "Elements of the counted data-plane collectives since the last reset_stats(), indexed by kind.")
      .def("reset_stats", [](const BoundQueue& q) { q.get().reset_stats(); })
      .def("close", &BoundQueue::close,
           "Completes the collectives already issued and stops the queue's threads (the GIL released meanwhile); "
           "dropping the queue does the same.");
}

}  // namespace zerocore::bindings
