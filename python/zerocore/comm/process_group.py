"""ProcessGroupTransport: the native comm queue's transport over a
torch.distributed process group.

The queue (zerocore._native.CommQueue) runs every collective of the engine
in issue order on its own thread; for a torch.distributed group it calls
these methods there, with the GIL held, one collective at a time. Tensors
arrive as DLPack views of the caller's tensors, so each collective works in
place on the engine's buffers. Each call issues its collective with
async_op=True and returns its completion, a callable that waits for the
work handles (and then does what follows them, as keeping this rank's block
of a reduce-scatter): the queue's completing thread calls it, and only then
is the queue's event set. "The call returned" is never taken for done,
since NCCL returns once a collective is queued. On gloo, which runs a
group's works on several threads, the call itself waits for the works (on
the queue's issuing thread) and returns None, so collectives stay a stream.

On CUDA tensors (the engine's backend a CudaBackend: issue_on) a collective
is work on the queue's comm stream: it is issued inside
torch.cuda.stream(the comm stream), so NCCL's own stream first waits for
what the comm stream was given (the engine's waits for the compute
stream), and the comm stream then waits for NCCL's (the works' wait(),
which does not block the host). The call returns None at once: the queue
sets the collective's event on its issuing thread, and the CUDA backend
records it on the comm stream there, right after the issue, so whoever
waits for it (the compute stream, on the device) waits for this
collective and nothing issued after it. Host tensors on such a queue (a gloo
group's) are read on the issuing thread, so it waits for the comm stream
before issuing their collective: what the comm stream was made to wait for
(a mailbox a kernel writes) is there when gloo reads it.

On gloo (host tensors) the tensor collectives all_gather_into_tensor and
reduce_scatter_tensor allocate full-size temporaries on every call, so peak
memory would depend on the system allocator, and they are the slowest of
gloo's collectives. There an all-gather is one in-place broadcast of each
rank's block (the same bytes moved, faster than gloo's own: bench/RESULTS.md),
except a small one (the control plane's rows, at most _SMALL_GATHER_BYTES),
which is gloo's own, one collective instead of one a rank, and a
reduce-scatter a ring of sends in place:
N - 1 steps, each sending a block of partial sums to the next rank and
adding the previous rank's into another, received into a scratch block
the transport keeps (the largest bucket's block, allocated once, so that
memory does not depend on the system allocator). A rank sends (N-1)/N of the bucket, as a reduce-scatter must; an
all-reduce of the bucket sends twice that. Other backends (NCCL) get the tensor collectives, and so do
gloo's CUDA tensors (staged through pinned host memory by gloo; it has no
send or recv for them): what several ranks on one GPU train over in the
tests (tests/test_gpu_ranks.py).

Timeouts: the engine's groups (private_group) take the timeout of the
group they were made from, or Config.timeout; torch would give them its
30-minute default. A collective whose peer does not join in time raises
zerocore.CollectiveTimeoutError naming it (`describe` names a key), from
its issue or from waiting for its works; on NCCL torch's watchdog acts too. What a failed collective does next (every later one fails at once; ranks
found apart hang up and abort): failure.py.

Positions: a collective the host waits in (gloo's, on host tensors) is in
flight until its wait ends; one on the device (NCCL's, gloo's on CUDA
tensors) until its works are done (Work.is_completed), asked when the
positions are read, so the host never waits for it.
"""
from __future__ import annotations

import contextlib
import datetime
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from zerocore._native import CollectiveTimeoutError
from zerocore.comm.errors import RankDisagreementError
from zerocore.comm.failure import Failure, abort, hang_up

# torch 2.13 renamed the tensor collectives; keep working with older names (every
# caller in zerocore goes through these two).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# A gloo all-gather of at most this many bytes (the control plane's
# agreements, meetings and exchange rows) is gloo's own, one collective,
# rather than a broadcast from each rank: its temporaries are a few bytes.
_SMALL_GATHER_BYTES = 4096


def group_timeout(group) -> Optional[datetime.timedelta]:
    """The timeout of `group`'s collectives (its backend's), or None where
    the backend shows none."""
    for device in getattr(group, "_device_types", ()):
        try:
            return group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def private_group(group, timeout: Optional[datetime.timedelta] = None, backend: Optional[str] = None):
    """A new process group of `group`'s ranks (a collective call of those
    ranks only), with `timeout`, or else `group`'s own, and `backend` (None:
    the default's)."""
    return dist.new_group(dist.get_process_group_ranks(group), timeout=timeout or group_timeout(group),
                          backend=backend, use_local_synchronization=True)


def _timed_out(error, elapsed: float, timeout) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text or \
        (timeout is not None and elapsed >= 0.9 * timeout.total_seconds())


# What torch's Work.wait(timeout) raises when the timeout passes first (the work goes on).
_WAIT_EXPIRED = "Operation timed out"


class ProcessGroupTransport:
    """positions: the engine's zerocore.comm.positions.Positions (None: none
    kept), where this transport notes its collectives as queue `queue`
    and, once one has waited its diagnose_after, finds ranks in different
    collectives (on gloo, whose host waits are here).

    SIMULATED_DEVICE_QUEUES: the queues (by name) whose gloo collectives on
    host tensors complete as NCCL's do on a GPU (a test seam, empty but in
    the CPU tests of it: tests/test_rank_disagreement_device.py): off the
    host, on the queue's completing thread, never diagnosed there, in
    flight until done, ended only by this rank's own abort (a flag the
    wait looks at: a peer's abort does not end it, as a peer's
    ncclCommAbort does not end an NCCL kernel). So the host waits for them
    in the backend's host waits, as on a GPU, where Positions.watch
    diagnoses."""

    SIMULATED_DEVICE_QUEUES = ()

    def __init__(self, group, describe=repr, failure: Optional[Failure] = None, positions=None, queue="data"):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.world_size)]
        self.gloo = dist.get_backend(group) == "gloo"  # host tensors: in place, completed on the issuing thread
        self.timeout = group_timeout(group)
        self.describe = describe  # key -> what the collective is, for errors
        self.failure = failure or Failure()
        self.stream = None  # CUDA: the queue's comm stream (issue_on)
        self.incoming = None  # gloo reduce-scatter: the scratch block each ring step receives into
        self.positions, self.queue = positions, queue
        # Host tensors' collectives complete on a device (see the class's doc): a simulated one.
        self.simulated_device = self.gloo and queue in self.SIMULATED_DEVICE_QUEUES
        self.aborted = False  # the simulated device's abort
        if self.simulated_device:
            self.failure.on_apart.append(self._abort_simulated_device)
        elif self.gloo:
            self.failure.on_apart.append(lambda: hang_up(group))
        else:
            self.failure.on_apart.append(lambda: abort(group))
        self.absent = None  # the last diagnosis' peers that had not started the collective waiting, for a timeout

    def issue_on(self, handle: int, device: int):
        """CUDA tensors' collectives go on the comm stream whose cudaStream_t
        is `handle`, of CUDA device `device` (the queue's, from its
        CudaBackend)."""
        self.stream = torch.cuda.ExternalStream(handle, device=torch.device("cuda", device))

    @contextlib.contextmanager
    def _running(self, key, start=None):
        """Runs (a part of) one collective issued at `start` (now if None):
        at once into the first failure, if there was one; a timeout raised as
        CollectiveTimeoutError naming it."""
        self.failure.check()
        start = time.monotonic() if start is None else start
        try:
            yield
        except RankDisagreementError as e:
            self.failure.record(RankDisagreementError, str(e))
            raise
        except Exception as e:
            apart = self.positions.found_apart() if self.positions is not None else None
            if apart is not None:  # a peer found the ranks in different collectives, and left or gave up
                self.failure.record(RankDisagreementError, apart)
                raise RankDisagreementError(apart) from None
            if not _timed_out(e, time.monotonic() - start, self.timeout):
                self.failure.record(RuntimeError, f"{self.describe(key)}: {type(e).__name__}: {e}")
                raise
            if self.positions is not None:  # where the peers are now: in another collective, or where they were last
                try:
                    self.absent = self.positions.diagnose(self.queue, time.monotonic() - start)
                except RankDisagreementError as apart:
                    self.failure.record(RankDisagreementError, str(apart))
                    raise
            message = self._timeout_message(key, e)
            self.failure.record(CollectiveTimeoutError, message)
            raise CollectiveTimeoutError(message) from None

    def _timeout_message(self, key, error) -> str:
        peers = [r for r in self.global_ranks if r != self.global_ranks[self.rank]]
        after = f" after {self.timeout.total_seconds():g} s" if self.timeout is not None else ""
        waiting = f"rank(s) {peers}" if len(peers) <= 8 else f"{len(peers)} other ranks"
        absent = f" ({self.absent})" if self.absent else ""
        return (f"zerocore: the {self.describe(key)} timed out{after} waiting for {waiting}{absent}; a peer is stuck "
                "or dead. "
                "The ranks are out of step now: every later call of this engine fails at once, so end the job "
                "and restart it (from a checkpoint); raise Config(timeout=...) if a peer is only slow. "
                f"(torch.distributed: {type(error).__name__}: {error})")

    def all_gather(self, key, shard, output):
        """output (world_size x shard) <- every rank's shard."""
        shard, output = torch.from_dlpack(shard), torch.from_dlpack(output)
        return self._issue(key, output.device, lambda: self._all_gather(shard, output))

    def reduce_scatter(self, key, input, shard):
        """shard <- this rank's block of the sum of every rank's input (the
        rest of input is scratch)."""
        input, shard = torch.from_dlpack(input), torch.from_dlpack(shard)
        return self._issue(key, shard.device, lambda: self._reduce_scatter(input, shard))

    def all_reduce(self, key, tensor):
        tensor = torch.from_dlpack(tensor)
        return self._issue(key, tensor.device,
                           lambda: ([dist.all_reduce(tensor, group=self.group, async_op=True)], None))

    def broadcast(self, key, tensor, root):
        """tensor <- the tensor of rank `root` of the group."""
        tensor = torch.from_dlpack(tensor)
        return self._issue(key, tensor.device, lambda: (
            [dist.broadcast(tensor, self.global_ranks[root], group=self.group, async_op=True)], None))

    def _issue(self, key, device, start):
        """Issues one collective on tensors on `device`: start() issues its
        works (async_op) and returns them and what runs once they are done
        (or None). Returns its completion, which the queue calls on its
        completing thread: the call returning says nothing of the data
        (NCCL's return once queued). On gloo, which runs a group's works on
        several threads at once, the collective completes here instead, on
        the queue's issuing thread, before the next is issued: so they stay
        a stream, and the GIL changes hands once a collective. On CUDA it is
        all on the comm stream (see the module's doc) and returns None."""
        issued = time.monotonic()
        if device.type == "cuda":
            if self.stream is None:
                raise TypeError(f"{self.describe(key)}: CUDA tensors on a queue whose backend is not a CudaBackend; "
                                "the engine's backend follows the module's device (zerocore/runtime/devices.py)")
            # In flight from before the issue (NCCL's first collective may
            # wait for the peers to connect) until its works are done.
            issued_works = []
            if self.positions is not None:
                self.positions.started(self.queue, key, self.describe, lambda: bool(issued_works) and all(
                    w.is_completed() for w in issued_works[0]))
            # The tensors' device made current on this (the queue's issuing)
            # thread, whatever it was: torch's NCCL group and its stream
            # context work on the current device.
            with self._running(key, issued), torch.cuda.device(device), torch.cuda.stream(self.stream):
                works, then = start()
                issued_works.append(works)
                for w in works:
                    w.wait()  # the comm stream waits for NCCL's: on the device
                if then is not None:
                    then()
            return None
        if self.stream is not None:
            # Host tensors on a CUDA queue (the control plane's gloo): the
            # comm stream was made to wait for what the collective reads (the
            # step's exchange row, which a kernel writes on the compute
            # stream), but gloo reads it on this thread, now: this thread
            # waits for the comm stream first, so the caller's thread blocks
            # only for the collective.
            self.stream.synchronize()
        if self.simulated_device:
            completion = _SimulatedDeviceCompletion(self, key, issued, start)
            if self.positions is not None:
                self.positions.started(self.queue, key, self.describe, completion.done.is_set)
            return completion
        if self.positions is not None:
            self.absent = None
            self.positions.started(self.queue, key, self.describe)
        with self._running(key, issued):
            works, then = start()
        completion = _Completion(self, key, issued, works, then)
        if not self.gloo:
            return completion
        completion()
        return None

    def _all_gather(self, shard, output):
        # The simulated device's waits end at its abort: each wait is cut in slices, as gloo's broadcasts' may be.
        if not self.gloo or (output.nbytes <= _SMALL_GATHER_BYTES and not self.simulated_device):
            return [all_gather_single(output, shard, group=self.group, async_op=True)], None
        blocks = output.view(self.world_size, -1)
        if blocks[self.rank].data_ptr() != shard.data_ptr():
            blocks[self.rank].copy_(shard)
        return [dist.broadcast(blocks[r], self.global_ranks[r], group=self.group, async_op=True)
                for r in range(self.world_size)], None

    def _reduce_scatter(self, input, shard):
        if self.simulated_device:  # an all-reduce, whose waits may be cut in slices (the ring's may not)
            return [dist.all_reduce(input, group=self.group, async_op=True)], \
                lambda: shard.copy_(input.view(self.world_size, -1)[self.rank])
        if not self._rings(input):
            return [reduce_scatter_single(shard, input, group=self.group, async_op=True)], None
        mine = self._ring_reduce_scatter(input)
        keep = None if mine.data_ptr() == shard.data_ptr() else lambda: shard.copy_(mine)
        return [], keep

    def _rings(self, input) -> bool:
        """Whether a reduce-scatter of `input` runs as the ring of sends
        (gloo on host tensors), or else as the group's tensor collective:
        NCCL's, and gloo's on CUDA tensors, where gloo has no send or recv
        (several ranks on one GPU over a gloo data group)."""
        return self.gloo and input.device.type == "cpu"

    def _ring_reduce_scatter(self, input):
        """This rank's block of input becomes the sum of every rank's (the
        other blocks, partial sums), and is returned: step s sends block
        rank - s - 1, which holds the sum of s + 1 ranks' by then, to the
        next rank and adds the previous rank's into block rank - s - 2, so
        the last step's lands in this rank's own. Completes here (gloo)."""
        n, rank = self.world_size, self.rank
        blocks = input.view(n, -1)
        incoming = self._scratch(blocks[rank]) if n > 1 else None  # one rank: its block is the sum
        to, source = self.global_ranks[(rank + 1) % n], self.global_ranks[(rank - 1) % n]
        for s in range(n - 1):
            # A send's or receive's wait with a timeout would end the pair (gloo closes it): waited for
            # whole. A peer that finds the ranks apart hangs up (hang_up), which ends the wait.
            for w in [dist.isend(blocks[(rank - s - 1) % n], to, group=self.group),
                      dist.irecv(incoming, source, group=self.group)]:
                w.wait()
            blocks[(rank - s - 2) % n] += incoming
        return blocks[rank]

    def wait(self, works):
        """Waits for a collective's works (on the queue's thread). With
        positions, each wait past diagnose_after reads the peers' (raising
        RankDisagreementError where they are in another collective) and goes
        on, until the group's own timeout ends it."""
        if self.positions is None or not self.gloo or self.simulated_device:
            for w in works:
                w.wait()
            return
        after = self.positions.diagnose_after
        waited = 0.0
        for w in works:
            while True:
                try:
                    w.wait(timeout=datetime.timedelta(seconds=after))
                    break
                except RuntimeError as e:
                    if _WAIT_EXPIRED not in str(e):
                        raise
                waited += after
                self.absent = self.positions.diagnose(self.queue, waited)

    def _abort_simulated_device(self):
        self.aborted = True

    def wait_on_device(self, works):
        """The simulated device's wait for its works: whole, but for this
        rank's abort (ProcessGroupTransport's doc)."""
        for w in works:
            while True:
                try:
                    w.wait(timeout=_DEVICE_POLL)
                    break
                except RuntimeError as e:
                    if _WAIT_EXPIRED not in str(e):
                        raise
                if self.aborted:
                    raise RuntimeError("the simulated device's collectives were aborted") from None

    def _scratch(self, like):
        """A tensor of like's size and dtype, a view of the scratch block,
        which grows (once per larger bucket) and is kept."""
        if self.incoming is None or self.incoming.dtype != like.dtype or self.incoming.numel() < like.numel():
            self.incoming = torch.empty(like.numel(), dtype=like.dtype)
        return self.incoming[:like.numel()]


# How often the simulated device's wait looks whether it was aborted.
_DEVICE_POLL = datetime.timedelta(milliseconds=50)


class _SimulatedDeviceCompletion:
    """A collective of the simulated device (ProcessGroupTransport's doc):
    issued and waited for when called, on the queue's completing thread,
    after those before it; `done` is set once it ended (or failed)."""

    def __init__(self, transport, key, issued, start):
        self.transport, self.key, self.issued, self.start = transport, key, issued, start
        self.done = threading.Event()

    def __call__(self):
        start, self.start = self.start, None
        try:
            with self.transport._running(self.key, self.issued):
                works, then = start()
                self.transport.wait_on_device(works)
                if then is not None:
                    then()
        finally:
            self.done.set()


class _Completion:
    """The completion of one collective issued on host tensors: calling it
    (once) waits for its works and runs what follows them; the tensors go
    with them."""

    def __init__(self, transport, key, issued, works, then):
        self.transport, self.key, self.issued = transport, key, issued
        self.works, self.then = works, then

    def __call__(self):
        works, then, self.works, self.then = self.works, self.then, None, None
        transport = self.transport
        with transport._running(self.key, self.issued):
            transport.wait(works)
            if then is not None:
                then()
        if transport.positions is not None:
            transport.positions.finished(transport.queue)
