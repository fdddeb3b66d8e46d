"""The native comm queue from Python: every collective of the engine runs on
one ordered queue per group, over torch.distributed or a Python transport;
it keeps the order contract's books, fails loudly with the transport's own
message, and never deadlocks on the GIL (a deadlock here is a hang, so the
cases that could hang run in a rank process with a deadline)."""
import gc
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

import zerocore
from dist_harness import run_ranks
from zerocore import _native, ops
from zerocore.comm import communicator as zcomm
from zerocore.comm.communicator import KINDS, CollectiveNames, Communicator

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, BROADCAST = range(4)


def _os_threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def _os_threads_once_exited(expected: int, deadline_s: float = 2.0) -> int:
    """The OS thread count, once threads already joined have left /proc.
    pthread_join returns when the kernel clears the thread's tid, a moment
    before the kernel unlists the exiting task, so a count taken right after
    a join can still see it. A thread never joined stays listed past the
    deadline, and the count then shows it."""
    end = time.monotonic() + deadline_s
    while _os_threads() != expected and time.monotonic() < end:
        time.sleep(0.001)
    return _os_threads()


class RecordingTransport:
    """A Python transport of one rank: collectives are the identity, and it
    records which ran, on which thread, and can be told to fail."""

    rank, world_size = 0, 1

    def __init__(self, fail_on=None, hold=None):
        self.calls, self.threads = [], set()
        self.fail_on, self.hold = fail_on, hold

    def _run(self, name):
        self.calls.append(name)
        self.threads.add(threading.get_ident())
        if self.hold is not None:
            self.hold.wait()  # Python on the queue's thread, while the issuer waits
        if name == self.fail_on:
            raise ValueError(f"the transport refused {name}")

    def all_gather(self, key, shard, output):
        self._run("all_gather")
        torch.from_dlpack(output).copy_(torch.from_dlpack(shard))

    def reduce_scatter(self, key, input, shard):
        self._run("reduce_scatter")

    def all_reduce(self, key, tensor):
        self._run("all_reduce")
        torch.from_dlpack(tensor).mul_(2)  # in place, seen by the issuer

    def broadcast(self, key, tensor, root):
        self._run("broadcast")


def test_single_process_queue_keeps_the_books():
    q = _native.CommQueue.single_process(_native.process_backend())
    assert (q.rank, q.world_size, q.trace_limit) == (0, 1, 100_000)
    start = q.fingerprint
    shard, full = torch.arange(4.0), torch.zeros(4)
    q.all_gather((ALL_GATHER, 3, 0, 4), shard, full).wait()
    assert torch.equal(full, shard)
    q.all_reduce(_native.CollectiveKey(ALL_REDUCE, 3, 1, 4), full, counted=False).wait()
    q.broadcast((BROADCAST, -1, 0, 4), full, 0).wait()  # control plane: not in the books
    assert q.trace() == [(ALL_GATHER, 3, 0, 4), (ALL_REDUCE, 3, 1, 4)]
    assert q.stats() == [4, 0, 0, 0]
    assert q.fingerprint != start
    q.restart_trace()
    q.reset_stats()
    assert (q.fingerprint, q.trace(), q.stats()) == (start, [], [0, 0, 0, 0])


@pytest.mark.parametrize("kind", ["host_pinned", "host_pageable"])
def test_a_data_plane_collective_refuses_host_memory(kind):
    # On CUDA the data plane is NCCL's, which moves device memory: a host
    # buffer of the backend's (an offloaded shard) must be copied up first.
    # The same check on every backend, so the CPU path is the CUDA path.
    backend = _native.CpuBackend()
    q = _native.CommQueue.single_process(backend)
    host = torch.from_dlpack(backend.allocate(kind, 16, "offloaded shard", zeroed=True).view(0, "float32", [4]))
    device = torch.from_dlpack(backend.allocate("device", 16, "gathered", zeroed=True).view(0, "float32", [4]))
    for call in (lambda: q.all_gather((ALL_GATHER, 3, 0, 4), host, device),
                 lambda: q.all_gather((ALL_GATHER, 3, 0, 4), device, host),
                 lambda: q.all_reduce((ALL_REDUCE, 3, 0, 4), host)):
        with pytest.raises(ValueError, match=f"an operand is {kind.replace('_', ' ')} memory; data-plane "
                                             "collectives move device memory"):
            call()
    assert q.trace() == []  # refused before anything was issued
    host.copy_(torch.arange(4.0))
    q.all_gather((ALL_GATHER, 3, 0, 4), device.copy_(host), torch.zeros(4)).wait()  # copied up: fine
    q.broadcast((BROADCAST, -1, 0, 4), host, 0).wait()  # the control plane moves host numbers
    assert torch.equal(host, torch.arange(4.0))
    q.close()


def test_bad_keys_and_tensors_name_the_problem():
    q = _native.CommQueue.single_process(_native.process_backend())
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="kind must be 0"):
        q.all_reduce((7, 0, 0, 4), t)
    with pytest.raises(TypeError, match=r"tuple \(kind, group, bucket, numel\)"):
        q.all_reduce((ALL_REDUCE, 0), t)
    with pytest.raises(TypeError, match="tensor must be float32"):
        q.all_reduce((ALL_REDUCE, 0, 0, 4), torch.zeros(4, dtype=torch.float64))
    q.close()
    with pytest.raises(RuntimeError, match="closed"):
        q.all_reduce((ALL_REDUCE, 0, 0, 4), t)


def test_collectives_are_named_by_their_native_kind_and_purpose():
    names = CollectiveNames()
    names.groups = ["fc.weight, fc.bias"]
    key = (_native.CollectiveKind.ALL_REDUCE, _native.CONTROL_GROUP, _native.ControlPurpose.ROUND, 8)
    assert names(key) == "control all_reduce of stage 3's round (8 elements)"
    assert names((2, -1, 1, 8)) == "control all_reduce of the step's norm exchange (8 elements)"  # as a trace holds it
    assert names((1, 0, 2, 16)) == "reduce_scatter of fc.weight, fc.bias, bucket 2 (16 elements)"
    assert KINDS == ("all_gather", "reduce_scatter", "all_reduce")  # the queue's stats, in this order


def _with_deadline(check):
    """Runs check() in a rank process: a GIL deadlock fails the test (as a
    hang past the deadline) instead of stalling the suite."""
    run_ranks(lambda rank, world: check(), 1, timeout=30)


def _transport_runs_in_place_on_the_queue_thread():
    transport = RecordingTransport()
    q = _native.CommQueue(transport, _native.process_backend())
    t = torch.ones(3)
    events = [q.all_reduce((ALL_REDUCE, 0, b, 3), t) for b in range(3)]
    events[-1].wait()
    assert all(e.ready() for e in events)  # in order: the earlier ones ran first
    assert torch.equal(t, torch.full((3,), 8.0))
    assert transport.calls == ["all_reduce"] * 3
    assert threading.get_ident() not in transport.threads


def test_python_transport_runs_in_place_on_the_queue_thread():
    _with_deadline(_transport_runs_in_place_on_the_queue_thread)


def _transport_error_comes_out_of_wait():
    q = _native.CommQueue(RecordingTransport(fail_on="reduce_scatter"), _native.process_backend())
    t = torch.zeros(4)
    event = q.reduce_scatter((REDUCE_SCATTER, 2, 1, 4), t, t)
    with pytest.raises(RuntimeError, match=r"reduce_scatter of group 2, bucket 1 \(4 elements\).*"
                                           r"ValueError: the transport refused reduce_scatter"):
        event.wait()
    # The ranks are out of step now: later collectives fail the same way.
    with pytest.raises(RuntimeError, match="the transport refused reduce_scatter"):
        q.all_reduce((ALL_REDUCE, 2, 2, 4), t).wait()


def test_transport_error_comes_out_of_wait_with_its_message():
    _with_deadline(_transport_error_comes_out_of_wait)


def _gil_handoffs():
    """Each step can only finish if no thread waits for the queue while
    holding the GIL: the transport runs Python on the queue's thread, and
    waits there for a third thread."""
    for how in ("wait", "close", "drop"):
        release = threading.Event()
        threading.Timer(0.2, release.set).start()
        q = _native.CommQueue(RecordingTransport(hold=release), _native.process_backend())
        events = [q.all_reduce((ALL_REDUCE, 0, b, 1), torch.ones(1)) for b in range(3)]
        if how == "wait":
            events[-1].wait()
        elif how == "close":
            q.close()  # drains first
        del q  # drains first, if still open
        assert all(e.ready() for e in events), how


def test_no_gil_deadlock_on_wait_close_or_drop():
    _with_deadline(_gil_handoffs)


def _collectives_over_gloo(rank, world):
    comm = Communicator(dist.group.WORLD, backend=_native.process_backend())
    out = {}
    # Data plane, in place as the engine issues it (natively, on comm.queue).
    full = torch.arange(4.0) + 10 * rank
    comm.all_gather(full, full[2 * rank:2 * rank + 2], (0, 0))
    out["gathered"] = full.tolist()
    grads = torch.arange(4.0) + rank
    comm.queue.reduce_scatter((REDUCE_SCATTER, 0, 1, 4), grads, grads[2 * rank:2 * rank + 2]).wait()
    out["reduced"] = grads[2 * rank:2 * rank + 2].tolist()
    summed = torch.full((3,), float(rank + 1), dtype=torch.bfloat16)
    comm.queue.all_reduce((ALL_REDUCE, 1, 0, 3), summed).wait()
    out["summed"] = summed.float().tolist()
    # Control plane: any dtype and layout, moved as bytes.
    payloads = [torch.tensor(rank + 7, dtype=torch.int64),
                torch.tensor([rank == 0] * 3),  # odd bytes
                torch.arange(12, dtype=torch.float64).mul(rank + 1).view(3, 4).t()]  # not contiguous
    for p in payloads:
        comm.broadcast(p)
    out["broadcast"] = [p.tolist() for p in payloads]
    out["ints"] = comm.gather_ints(100 + rank)
    out["stats"] = dict(comm.stats)
    out["trace"] = comm.trace
    # The native step's exchange over the control queue: the sums (rank r's
    # grads: r + 1 ones), and the fingerprints checked.
    grad = torch.ones(rank + 1)
    runs = ops.FlatRuns([0], [torch.zeros(rank + 1)], [grad], [None], [None], [None])
    step = _native.ZeroStep(comm.queue, comm.control_queue, runs, partitioned=True)
    out["exchanged"] = step.exchange(rank)
    out["trace after check"] = comm.trace
    return out


def test_communicator_over_gloo():
    results = run_ranks(_collectives_over_gloo, 2, timeout=60)
    for rank, r in enumerate(results):
        assert r["gathered"] == [0.0, 1.0, 12.0, 13.0]
        assert r["reduced"] == [[1.0, 3.0], [5.0, 7.0]][rank]
        assert r["summed"] == [3.0] * 3
        assert r["broadcast"] == [7, [True] * 3, torch.arange(12, dtype=torch.float64).view(3, 4).t().tolist()]
        assert r["ints"] == [100, 101]
        assert r["stats"] == {"all_gather": 4, "reduce_scatter": 4, "all_reduce": 3}
        assert r["trace"] == [(0, 0, 0, 4), (1, 0, 1, 4), (2, 1, 0, 3)]  # the data plane only
        assert r["exchanged"] == (3.0, 1) and r["trace after check"] == []


def _alone(rank, world):
    """A Communicator of a group of one: what its queue is, and what its collectives do."""
    made = []
    real = zcomm.ProcessGroupTransport
    zcomm.ProcessGroupTransport = lambda *args, **kwargs: made.append(real(*args, **kwargs)) or made[-1]
    try:
        comm = Communicator(dist.group.WORLD, backend=_native.process_backend())
    finally:
        zcomm.ProcessGroupTransport = real
    shard, full = torch.arange(4.0), torch.zeros(4)
    comm.queue.all_gather((ALL_GATHER, 0, 0, 4), shard, full).wait()
    grads, mine = torch.arange(4.0) + 1, torch.zeros(4)
    comm.queue.reduce_scatter((REDUCE_SCATTER, 0, 1, 4), grads, mine).wait()
    return comm.queue.stream.name, len(made), full, mine, comm.trace


def test_a_group_of_one_gets_a_queue_of_its_own():
    """One process under torchrun (a GPU's bench, a single-GPU job): no
    Python transport and no queue thread between the native schedules and
    the comm stream; every collective is the identity on its data."""
    name, transports, full, mine, trace = run_ranks(_alone, 1, timeout=60)[0]
    assert (name, transports) == ("comm (alone)", 0)
    assert torch.equal(full, torch.arange(4.0)) and torch.equal(mine, torch.arange(4.0) + 1)
    assert trace == [(ALL_GATHER, 0, 0, 4), (REDUCE_SCATTER, 0, 1, 4)]  # the books as any queue's


def _reduce_scatter_sends(rank, world):
    """This rank's block of a gloo reduce-scatter through the queue, against
    the sum taken here in float64, and the elements this rank's
    torch.distributed calls sent for it."""
    sent = []
    calls = {name: getattr(dist, name) for name in ("isend", "send", "broadcast", "all_reduce")}

    def recording(name):
        def call(tensor, *args, **kwargs):
            sent.append((name, tensor.numel()))
            return calls[name](tensor, *args, **kwargs)
        return call

    comm = Communicator(dist.group.WORLD, backend=_native.process_backend())
    numel = 6 * world
    inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
    grads = inputs[rank].clone()
    block = grads[rank * 6:(rank + 1) * 6]
    for name in calls:
        setattr(dist, name, recording(name))
    try:
        comm.queue.reduce_scatter((REDUCE_SCATTER, 0, 0, numel), grads, block).wait()
    finally:
        for name, fn in calls.items():
            setattr(dist, name, fn)
    expected = torch.stack(inputs).double().sum(0)[rank * 6:(rank + 1) * 6]
    return block.double().tolist(), expected.tolist(), sent


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gloo_reduce_scatter_sends_what_a_reduce_scatter_needs(world):
    """(N-1)/N of the bucket a rank, in sends of one block each: an
    all-reduce of the bucket (the transport's reduce-scatter before) sends
    twice that."""
    for rank, (got, expected, sent) in enumerate(run_ranks(_reduce_scatter_sends, world, timeout=60)):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-6, atol=1e-6)
        assert sent == [("isend", 6)] * (world - 1), f"rank {rank} sent {sent}"


def _drop_communicators(group):
    """(OS threads, arena bytes) before and after dropping communicators
    with a collective still in flight."""
    def use_and_drop():
        comm = Communicator(group, backend=_native.process_backend())
        flat = zerocore.to_torch(zerocore.empty([8]))
        comm.queue.all_reduce((ALL_REDUCE, 0, 0, 8), flat)  # left in flight

    use_and_drop()  # whatever the first collective starts for good
    gc.collect()  # no earlier test's cycle may be freed mid-measurement
    before = (_os_threads(), zerocore.host_arena_bytes())
    for _ in range(5):
        use_and_drop()
    return before, (_os_threads_once_exited(before[0]), zerocore.host_arena_bytes())


def test_dropped_communicator_frees_its_queue_thread_and_tensors():
    before, after = _drop_communicators(None)  # the single-process queue
    assert after == before


def test_dropped_communicator_over_gloo_frees_its_queue_thread_and_tensors():
    # gloo's worker thread lets go of a collective's tensors a moment after
    # the collective completes; closing the queue waits for that.
    results = run_ranks(lambda rank, world: _drop_communicators(dist.group.WORLD), 2, timeout=60)
    for before, after in results:
        assert after == before
