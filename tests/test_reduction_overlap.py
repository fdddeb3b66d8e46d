"""Stage 3's reductions run behind backward compute, not before it (issue 20).

A unit's grads are reduced in the round that the next unit's backward
posts, settled one unit later: the reduce-scatter of the unit two before in
backward order is issued at the hook where a unit's backward begins. The
reduce staging holds three units' buckets (EngineCore's staging_for, cpp/src/engine/engine_core.cpp),
so that unit takes a free buffer for its grads and computes while the
reduce-scatter goes on. With two, taking its grad views completed the
reduce-scatter just issued (BucketReducer frees a buffer by completing the
oldest reduction in flight): the backward waited for every unit's
reduction in turn (bench/RESULTS.md has what that cost the GPT bench).

A unit of several buckets issues them together; each is completed (the
compute stream waits for it) only when a bucket needs its staging, not at
the next one's issue: with one reduction in flight at most, a unit's
backward waited for all but the last of the buckets issued at its start.

Seen without timing: a reduction lands in its unit's grad partition only
when the compute stream completes it, so when a unit's backward begins the
partition of the unit two before it must still be empty, and every unit's
must be full once backward has ended."""
import pytest
import torch

import zerocore
from dist_harness import run_ranks
from models import TinyLM, lm_batch, lm_loss, local, make

LARGE, SMALL = 1 << 20, 512  # bytes per bucket: one bucket a group, or several


def _reduced(unit) -> bool:
    """Some of the unit's reduced grads are in its grad partitions."""
    return any(g.buffers["grad_part"].any() for g in unit.groups if g.trainable)


def _reduced_at_backward_starts(rank, world, layers, bucket_bytes):
    model = make(TinyLM, layers=layers)
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           zerocore.Config(stage=3, bucket_bytes=bucket_bytes))
    buckets = min(sum(len(g.buckets) for g in u.groups if g.trainable) for u in engine.parts.scheduler.units[1:])
    assert buckets > 1 if bucket_bytes == SMALL else buckets == 1, f"{buckets} buckets a block"
    scheduler = engine.parts.scheduler
    blocks = scheduler.units[1:]
    attach = scheduler.on_unit_backward
    starts = []  # per block's backward start: (block, the blocks whose reduced grads have landed)

    def on_unit_backward(unit):
        attach(unit)  # takes the unit's staging: where a wait for a reduction would be
        if unit.index != 0:
            starts.append((unit.index, [u.index for u in blocks if _reduced(u)]))

    scheduler.on_unit_backward = on_unit_backward
    x, y = lm_batch(0, 0, world)
    engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    after = [u.index for u in blocks if _reduced(u)]
    engine.close()
    return starts, after


@pytest.mark.parametrize("bucket_bytes", [LARGE, SMALL], ids=["a bucket a unit", "buckets a unit"])
def test_a_units_backward_does_not_wait_for_the_reduction_issued_at_its_start(bucket_bytes):
    layers = 5
    for starts, after in run_ranks(_reduced_at_backward_starts, 2, layers, bucket_bytes, timeout=120):
        order = [u for u, _ in starts]
        assert order == list(range(layers, 0, -1)), f"blocks' backward order {order}"
        assert sorted(after) == list(range(1, layers + 1)), f"blocks reduced after backward: {after}"
        for i, (unit, reduced) in enumerate(starts):
            if i >= 2:
                assert order[i - 2] not in reduced, (
                    f"block {unit}'s backward began after block {order[i - 2]}'s reduction completed: it waited for "
                    f"the reduce-scatter issued at its start (reduced by then: {reduced})")
