"""A stream-order violation inside a stage-3 forward or backward on one
rank ends in an error on every rank, not a hang (run under
ZEROCORE_BACKEND=checking: tests/run.sh's checking pass; skipped otherwise).

The violation is a hook-level missing wait: while unit 2 (the second
block) computes on rank 1, its gathered slot is written on a stream that
the compute stream never waits for (a comm queue over rank 1 alone). The
write's own issue is checked first and raises; that error is dropped, as
a stray copy engine's write would go unseen, so what names the problem is
the unit's post hook, whose declared read of its params (the last one,
before its slot may be gathered into again) is not ordered after the
write: StreamOrderError on rank 1, inside the hook. Every other rank then
raises at the round where rank 1 says it failed. 2 and 4 ranks, gloo."""
import pytest
import torch

import zerocore
from backward_call import CallInBackward
from dist_harness import RankError, run_ranks
from models import lm_batch, lm_loss, local, make
from zerocore import _native
from zerocore.comm import KINDS

pytestmark = pytest.mark.skipif(_native.process_backend() != "checking",
                                reason="stream order is checked under ZEROCORE_BACKEND=checking only")

BLOCK = 1  # model.blocks[BLOCK] is unit BLOCK + 1 (the root is unit 0)
TIMEOUT = 30  # seconds: the engine's collectives' (a hang would end in a timeout error, not the errors below)


def _write_unawaited(weight):
    """Zeros into the slot `weight` views, on a comm stream of its own that
    the compute stream does not wait for."""
    flat = weight.detach().view(-1)
    queue = _native.CommQueue.single_process()
    try:
        queue.all_gather((KINDS.index("all_gather"), 99, 0, flat.numel()), torch.zeros_like(flat), flat).wait()
    except _native.StreamOrderError:
        pass  # the write's own check; the hook's must name it too


def _violation_on_rank_1(rank, world, where):
    model = make()
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           {"stage": 3, "timeout": TIMEOUT})
    up = model.blocks[BLOCK].up
    step = 0

    def write():
        if rank == 1 and step == 1:
            _write_unawaited(up.weight)

    if where == "forward":
        up.register_forward_pre_hook(lambda m, args: write())
    else:
        up.register_forward_pre_hook(lambda m, args: (CallInBackward.apply(args[0], write),))
    for step in range(2):
        x, y = lm_batch(step, 0, world)
        engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
        engine.step()
        engine.zero_grad()
    return "trained"


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("world", [2, 4])
def test_a_stream_order_error_on_one_rank_raises_on_every_rank(world, where):
    results = run_ranks(_violation_on_rank_1, world, where, raise_errors=False, timeout=TIMEOUT + 60)
    assert all(isinstance(r, RankError) for r in results), results
    failed = results[1]
    assert failed.exc_type == "StreamOrderError", failed
    unit = BLOCK + 1
    assert f"then 'unit {unit}'s {where} ends reading its params' on stream 'compute' reads" in failed.message, failed
    assert "unordered accesses to buffer 'gathered units'" in failed.message, failed
    for r in results[:1] + results[2:]:
        assert "1 other rank(s) failed during this" in r.message, r
        assert "timed out" not in r.message, r
