"""A stream-order violation inside a stage-3 forward or backward on one
rank ends in an error on every rank, not a hang (run under
ZEROCORE_BACKEND=checking: tests/run.sh's checking pass; skipped otherwise).

The violation is a hook-level missing wait: while unit 2 (the second
block) computes on rank 1, its gathered slot is written on a stream that
the compute stream never waits for (a comm queue over rank 1 alone, whose
gather waits for compute but whose event nobody waits for), so what names
the problem is the unit's post hook, whose declared read of its params (the last one,
before its slot may be gathered into again) is not ordered after the
write: StreamOrderError on rank 1, inside the hook. Every other rank then
raises at the round where rank 1 says it failed. 2 and 4 ranks, gloo.

The second violation is one a collective's own check finds: unit 1's slot,
released once its forward ends, is written on rank 1 the same way, and
the next gather into that slot (unit 2's, needed at once without prefetch,
in the forward; a prefetch at the backward's start otherwise) writes it without
the comm stream having waited for that write. The queue issues that gather
all the same, and the round takes its remaining decisions, before rank 1
raises; so every other rank hears of it at the next round, not on a
collective's timeout."""
import pytest
import torch
import torch.distributed as dist

import zerocore
from backward_call import CallInBackward
from dist_harness import RankError, run_ranks
from models import lm_batch, lm_loss, local, make
from zerocore import _native
from zerocore.comm.communicator import KINDS

pytestmark = pytest.mark.skipif(not isinstance(_native.process_backend(), _native.CheckingBackend),
                                reason="stream order is checked under ZEROCORE_BACKEND=checking only")

BLOCK = 1  # model.blocks[BLOCK] is unit BLOCK + 1 (the root is unit 0)
TIMEOUT = 30  # seconds: the engine's collectives' (a hang would end in a timeout error, not the errors below)


def _write_unawaited(weight):
    """Zeros into the slot `weight` views, on a comm stream of its own that
    the compute stream does not wait for: the gather waits for compute (a
    collective issued from Python does, as torch's NCCL backend waits for
    the current stream), and its event is never waited for, so what reads or
    writes the slot next is unordered with it."""
    flat = weight.detach().view(-1)
    queue = _native.CommQueue.single_process(_native.process_backend())  # the engine's
    queue.all_gather((KINDS.index("all_gather"), 99, 0, flat.numel()), torch.zeros_like(flat), flat)


def _engine(model, **config):
    return zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                         {"stage": 3, "timeout": TIMEOUT, **config})


def _train_two_steps(rank, world, engine):
    """Two steps on this rank's share of the batch. What they raise goes up
    only once every rank is done (a barrier on a gloo group of its own): a
    rank that exited would close its connections, and that, not the engine,
    would end the others' wait."""
    ended = dist.new_group(backend="gloo")
    try:
        for step in range(2):
            x, y = lm_batch(step, 0, world)
            engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
            engine.step()
            engine.zero_grad()
    finally:
        dist.barrier(group=ended)
    return "trained"


def _assert_every_rank_failed_with_rank_1(results, where=""):
    """Rank 1 raised StreamOrderError; every other rank heard of it in the
    round protocol; no rank's error, or any error it was raised while
    handling, is a timeout."""
    assert all(isinstance(r, RankError) for r in results), results
    assert results[1].exc_type == "StreamOrderError", results[1]
    for r in results[:1] + results[2:]:
        assert f"1 other rank(s) failed during this {where}" in r.message, r
    for r in results:
        assert "timed out" not in str(r).lower(), r  # the traceback, its chained errors too


def _violation_on_rank_1(rank, world, where):
    model = make()
    engine = _engine(model)
    up = model.blocks[BLOCK].up

    def write():
        if rank == 1 and engine.step_count == 1:
            _write_unawaited(up.weight)

    if where == "forward":
        up.register_forward_pre_hook(lambda m, args: write())
    else:
        up.register_forward_pre_hook(lambda m, args: (CallInBackward.apply(args[0], write),))
    return _train_two_steps(rank, world, engine)


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("world", [2, 4])
def test_a_stream_order_error_on_one_rank_raises_on_every_rank(world, where):
    results = run_ranks(_violation_on_rank_1, world, where, raise_errors=False, timeout=TIMEOUT + 60)
    _assert_every_rank_failed_with_rank_1(results)
    unit = BLOCK + 1
    assert f"then 'unit {unit}'s {where} ends reading its params' on stream 'compute' reads" in results[1].message
    assert "unordered accesses to buffer 'gathered units'" in results[1].message


def _gather_into_written_slot(rank, world, prefetch_bytes):
    model = make()
    engine = _engine(model, prefetch_bytes=prefetch_bytes)
    first = model.blocks[0]
    slot = []

    def keep_slot(module, args):
        slot[:] = [first.up.weight.detach()]  # bound now: a view of unit 1's slot

    def write(module, args, output):
        if rank == 1 and engine.step_count == 1:  # unit 1's forward has ended, its slot released
            _write_unawaited(slot[0])

    first.up.register_forward_pre_hook(keep_slot)
    first.register_forward_hook(write)  # after the engine's post hook, which releases the slot
    return _train_two_steps(rank, world, engine)


# No prefetch: one slot, which unit 2's gather needs in the forward. The
# fewest slots with prefetch (2): both units are gathered ahead at the
# backward's start.
@pytest.mark.parametrize("prefetch_bytes, where", [(0, "forward"), (1, "backward")])
@pytest.mark.parametrize("world", [2, 4])
def test_a_gather_into_a_slot_written_unordered_raises_on_every_rank(world, prefetch_bytes, where):
    results = run_ranks(_gather_into_written_slot, world, prefetch_bytes, raise_errors=False, timeout=TIMEOUT + 60)
    _assert_every_rank_failed_with_rank_1(results, where)
    failed = results[1].message
    assert "then 'all_gather of group " in failed and "on stream 'comm (rank 1)' writes" in failed, failed
    assert "unordered accesses to buffer 'gathered units'" in failed, failed
