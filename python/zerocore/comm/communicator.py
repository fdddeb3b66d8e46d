"""Collectives of the engine, on one native ordered queue per process group.

Every collective goes through `Communicator.queue`, a
zerocore._native.CommQueue, the group's comm stream, a stream of the
engine's backend (devices.decide): native threads that issue the group's
collectives in the order they were issued and complete them in that order,
each through its event (never "the call returned": nothing reads an output
or reuses an input before waiting for it), over a ProcessGroupTransport
(torch.distributed; on a CudaBackend it issues CUDA tensors' collectives on
the comm stream itself), over zerocore's own NCCL transport (the data
group with Config(nccl="native"): zerocore/comm/nccl.py) or, for a rank alone (no
process group, or a group of one: one GPU under torchrun), a queue of its
own where every collective is the identity: a copy on the comm stream where
its output is not its input, issued by the caller, with no transport,
thread or Python between the native schedules and the stream. Native code
issues on the same queue, in the same order.

Data plane: the collectives whose volume the ZeRO formulas predict, keyed
by (kind, the flat group's tag, the same on every rank, bucket, elements).
The queue counts them in elements at their full, unpartitioned size: an
all-gather by its output, a reduce-scatter by its input, an all-reduce by
its tensor. Control plane (layout checks, overflow flags, norms, buffer
broadcasts): keyed with group -1 and, in the bucket, what they are for (an
error names it), neither counted nor in the order contract, always waited
on. Agreements and sums travel on the control queue, over a host (gloo)
group beside the data group (the engine's `control`), so they never wait
behind data collectives and, with NCCL for data, never make the GPU
synchronise. Their payloads (int64 hashes, float64 sums, buffers of any
dtype) cross the queue as raw bytes, since it moves float tensors only, so
they are only ever gathered or broadcast; sums are taken here, in rank
order, so every rank gets the same bits.

The order contract: the queue folds every data-plane key, as it is issued,
into a running fingerprint (and keeps the first TRACE_LIMIT in a trace).
Once a step, the native step (zerocore._native.ZeroStep) exchanges the
fingerprint in its one control collective, so ranks that issued different
collectives (another unit, bucket or size, or another order) raise
CollectiveOrderError on every rank before anything is updated, at no extra
collective per call. Only on that error path do ranks exchange their traces
(order_error), to name the first collective where they parted.
"""
from __future__ import annotations

import weakref
from collections import Counter

import torch
import torch.distributed as dist

from zerocore import _native
from zerocore.runtime import devices
from zerocore.comm import nccl as native_nccl
from zerocore.comm.errors import CollectiveOrderError
from zerocore.comm.failure import Failure
from zerocore.comm.process_group import ProcessGroupTransport, group_timeout

CollectiveKind = _native.CollectiveKind
# The data plane's kinds by name, in native CollectiveKind's order (the queue's stats').
KINDS = tuple(k.name.lower() for k in CollectiveKind if k is not CollectiveKind.BROADCAST)
ControlPurpose = _native.ControlPurpose  # what a control collective is for, in its key's bucket
_CONTROL = _native.CONTROL_GROUP  # the key group of control-plane collectives
_PURPOSES = {ControlPurpose.ROUND: "stage 3's round", ControlPurpose.NORMS: "the step's norm exchange",
             ControlPurpose.AGREEMENT: "the ranks' agreement (at wrap, load or save)",
             ControlPurpose.BROADCASTS: "a broadcast of buffers or params",
             ControlPurpose.MICRO_BATCHES: "the ranks' micro-batch counts (before a forward or backward, or at the step)",
             ControlPurpose.EXACT_GRADS: "the exact sum of the grads (Config(deterministic=True))"}
MICRO_BATCHES = ControlPurpose.MICRO_BATCHES  # the engine's meeting (engine/meeting.py)


def _as_halves(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor holding an even number of them, as
    float16 elements: a payload the native queue can move."""
    return t.reshape(-1).view(torch.uint8).view(torch.float16)


class CollectiveNames:
    """Names a collective by its key, for errors: a data-plane one by its
    flat group's params (once `groups` lists their labels, by tag), a
    control one by what it is for."""

    def __init__(self):
        self.groups = []

    def __call__(self, key) -> str:
        kind, tag, bucket, numel = key
        name = CollectiveKind(kind).name.lower()
        if tag < 0:
            purpose = _PURPOSES.get(bucket, f"unknown purpose {bucket}")
            return f"control {name} of {purpose} ({numel:,} elements)"
        if tag == _native.STEP_VERDICT_GROUP:
            return f"{name} of the step's finite-grads verdict ({numel:,} elements)"
        group = self.groups[tag] if tag < len(self.groups) else f"flat group {tag}"
        return f"{name} of {group}, bucket {bucket} ({numel:,} elements)"


class Communicator:
    """The collectives of one process group (None: this process alone), on
    a comm stream of `backend` (a zerocore._native.Backend: the engine's).
    fails_with: a Communicator of the same engine; after a failed
    collective on either, every collective of both fails at once. control:
    the Communicator whose queue carries this one's agreements and sums (a
    host group beside this data group; None: this one's queue), so that they
    never wait behind data collectives nor need the data group to move host
    tensors. plane: its comm stream's (zerocore._native.StreamPlane),
    CONTROL for a group of the control plane (agreements, rounds). nccl:
    Config.nccl, for the data plane on CUDA: "native" makes the queue over
    zerocore's own NCCL transport (zerocore/comm/nccl.py) instead of a
    ProcessGroupTransport, also for a group of one (else a rank alone's
    queue), the one way to run the engine over it on a single GPU. names:
    the CollectiveNames of the Communicator of the same flat groups (the
    reductions' beside the data's); None: its own. positions: the engine's
    zerocore.comm.positions.Positions, where the transport notes its collectives
    as queue `name` and finds ranks in different ones (None: none kept;
    on the native NCCL transport the transport keeps them: follow)."""

    def __init__(self, group, fails_with=None, control=None, *, backend, plane=_native.StreamPlane.DEVICE,
                 nccl="torch", names=None, positions=None, name="data"):
        self.group = group
        self.distributed = group is not None
        self.backend = backend
        self.names = names if names is not None else CollectiveNames()
        self.failure = fails_with.failure if fails_with is not None else Failure()
        if nccl == "native" and not devices.is_cuda(backend):
            raise ValueError("zerocore: Config(nccl=\"native\") issues the data plane's collectives with NCCL on "
                             "CUDA, but this model trains on the CPU; use Config(nccl=\"torch\")")
        if self.distributed and nccl == "native":
            self.queue, monitor = native_nccl.queue(group, backend, group_timeout(group))
            # Its collectives in flight until done on the device; aborted once the ranks are found apart.
            if positions is not None:
                positions.follow(name, monitor.progress, self.names)
            self.failure.on_apart.append(monitor.abort)
        elif self.distributed and dist.get_world_size(group) > 1:
            transport = ProcessGroupTransport(group, self.names, self.failure, positions, name)
            self.queue = _native.CommQueue(transport, backend, plane)
            if devices.is_cuda(backend):
                transport.issue_on(backend.stream_handle(self.queue.stream), backend.device)
        else:
            self.queue = _native.CommQueue.single_process(backend, plane)
        # Drain the queue when this communicator goes, or at the latest at
        # interpreter exit, while the queue's thread can still take the GIL
        # to finish a collective that is in flight.
        self._drain = weakref.finalize(self, self.queue.close)
        self.control_queue = control.queue if control is not None else self.queue
        self.rank = self.queue.rank
        self.world_size = self.queue.world_size

    @property
    def stats(self) -> Counter:
        """Elements moved per data-plane kind since wrap or reset_stats()."""
        return Counter(dict(zip(KINDS, self.queue.stats())))

    def reset_stats(self):
        self.queue.reset_stats()

    def close(self):
        """Drains and stops the queue now (after what is in flight)."""
        self._drain()

    @property
    def trace(self) -> list:
        """(kind, group tag, bucket, elements) of the first TRACE_LIMIT
        data-plane collectives since the last check."""
        return self.queue.trace()

    @property
    def TRACE_LIMIT(self) -> int:
        """Collectives remembered between checks, for naming where ranks
        parted (the fingerprint covers all of them): an engine used for
        inference only, never stepping, must not grow without bound. Kept
        by the queue; set on an instance, it bounds that queue's trace."""
        return self.queue.trace_limit

    @TRACE_LIMIT.setter
    def TRACE_LIMIT(self, limit: int):
        self.queue.trace_limit = limit

    # Data plane -----------------------------------------------------------
    # The engine's own data-plane collectives are issued natively on
    # self.queue (the schedule, gradient reduction, the step's gathers);
    # this one serves whole-model views.
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, key, count=True):
        """output (N x shard) <- every rank's shard, in place when shard is
        this rank's block of output, before torch's next work reads it (the
        compute stream waits for it: on CUDA on the device). key: (group
        tag, bucket)."""
        self.queue.all_gather((CollectiveKind.ALL_GATHER, *key, output.numel()), shard, output, count).compute_waits()

    # Control plane (uncounted) ----------------------------------------------
    # Broadcasts move the model's own tensors (params, buffers: on the data
    # group's device), so they go on the data queue, and torch's work that
    # follows reads them after the compute stream's wait; everything else
    # here is host numbers, on the control queue, which the host waits for.
    def broadcast(self, tensor: torch.Tensor, src_rank: int = 0):
        """tensor <- rank src_rank's tensor, whatever its dtype and layout."""
        t = tensor.detach()
        nbytes = t.numel() * t.element_size()
        if t.is_contiguous() and nbytes % 2 == 0:
            self._broadcast_halves(_as_halves(t), src_rank)
            return
        staged = torch.zeros(nbytes + nbytes % 2, dtype=torch.uint8, device=t.device)
        staged[:nbytes] = t.contiguous().reshape(-1).view(torch.uint8)
        self._broadcast_halves(staged.view(torch.float16), src_rank)
        t.copy_(staged[:nbytes].view(t.dtype).view(t.shape))

    def _broadcast_halves(self, halves, src_rank):
        key = (CollectiveKind.BROADCAST, _CONTROL, ControlPurpose.BROADCASTS, halves.numel())
        self.queue.broadcast(key, halves, src_rank).compute_waits()

    def gather_ints(self, value: int, purpose=ControlPurpose.AGREEMENT, after_compute=True) -> list:
        """Every rank's int, in rank order; purpose: what it is for (_PURPOSES), named if it fails;
        after_compute=False: it waits for no device work (a host number), as stage 3's rounds do not."""
        return [row[0] for row in self._gather_rows([value], torch.int64, purpose, after_compute)]

    def gather_int_rows(self, values, purpose=ControlPurpose.AGREEMENT) -> list:
        """Every rank's list of ints (int64, all of one length), in rank order."""
        return self._gather_rows(values, torch.int64, purpose)

    def raise_together(self, error, others: str, error_type=ValueError):
        """Where any rank failed, every rank raises instead of waiting for it
        in the next collective: this rank its own `error` (an exception; None
        when it did not fail), the others error_type(others), with "{ranks}"
        in `others` replaced by the ranks that failed."""
        failed = [r for r, x in enumerate(self.gather_ints(-1 if error is not None else 0)) if x == -1]
        if error is not None:
            raise error
        if failed:
            raise error_type(others.format(ranks=failed))

    def gather_text(self, text: str) -> list:
        """Every rank's string, in rank order (one collective when all are
        empty, as on every path where nothing went wrong)."""
        data = text.encode()
        lengths = self.gather_ints(len(data))
        if not any(lengths):
            return [""] * self.world_size
        words = -(-max(lengths) // 8)
        padded = data.ljust(8 * words, b"\0")
        rows = self._gather_rows([int.from_bytes(padded[i:i + 8], "little", signed=True)
                                  for i in range(0, len(padded), 8)], torch.int64)
        return [b"".join(w.to_bytes(8, "little", signed=True) for w in row)[:n].decode()
                for row, n in zip(rows, lengths)]

    def order_error(self, trace) -> CollectiveOrderError:
        """Ranks' order fingerprints differ (found by the native step's
        exchange): the error naming where they parted, once the ranks
        exchanged their traces (this rank's: `trace`). Call it on every rank."""
        return CollectiveOrderError(self._divergence(trace))

    def _divergence(self, trace) -> str:
        """The error path: ranks exchange their traces and name the first
        collective where they parted."""
        lengths = self.gather_ints(len(trace))
        longest = max(lengths)
        mine = [x for entry in trace for x in entry] + [-1] * (4 * (longest - len(trace)))
        rows = self._gather_rows(mine, torch.int64)
        traces = [[tuple(row[i:i + 4]) for i in range(0, 4 * n, 4)] for row, n in zip(rows, lengths)]
        first = next((i for i in range(longest) if len({t[i] if i < len(t) else None for t in traces}) > 1), None)
        if first is None:
            return (f"zerocore: ranks issued different collectives since the last step, after the first "
                    f"{longest:,}, which agree. Nothing was updated. Every rank must issue the same collectives in "
                    "the same order.")

        def what(t):
            if first >= len(t):
                return "nothing more before the step"
            return self.names(t[first])

        ranks = "\n".join(f"  rank {r}: {what(t)}" for r, t in enumerate(traces))
        return (f"zerocore: ranks issued different collectives since the last step; collective #{first + 1} was\n"
                f"{ranks}\nNothing was updated. Every rank must issue the same collectives in the same order.")

    def _gather_rows(self, values, dtype, purpose=ControlPurpose.AGREEMENT, after_compute=True) -> list:
        """Every rank's list of numbers (all of one length, 8-byte dtype), in rank order."""
        t = torch.tensor(values, dtype=dtype)
        out = torch.empty(self.world_size * t.numel(), dtype=dtype)
        rows = _as_halves(out)
        key = (CollectiveKind.ALL_GATHER, _CONTROL, purpose, rows.numel())
        self.control_queue.all_gather(key, _as_halves(t), rows, after_compute=after_compute).wait()
        return out.view(self.world_size, -1).tolist()
