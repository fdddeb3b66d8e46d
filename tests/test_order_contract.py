"""The order contract: ranks that issue different collectives (another
bucket, key or order) get CollectiveOrderError on every rank, naming where
they parted, with nothing updated; never silently mispaired data. (Ranks
that run different stage-3 units agree on what to gather instead:
test_divergent_units.py.)"""
import pytest
import torch

import zerocore
from dist_harness import run_ranks
from models import lm_batch, lm_loss, local, make


def _train_one_step(rank, world, model_fn, stage, tamper=None):
    model = model_fn()
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           {"stage": stage, "bucket_bytes": 1024})
    if tamper:
        tamper(engine, rank)
    before = engine.full_state_dict()
    x, y = lm_batch(0, 0, world)
    engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    try:
        engine.step()
    except zerocore.CollectiveOrderError as e:
        after = engine.full_state_dict()
        return str(e), all(torch.equal(before[k], after[k]) for k in before)
    return None, None


def _assert_raised_everywhere(results, *expected):
    for message, unchanged in results:
        assert message is not None, "no CollectiveOrderError"
        assert unchanged, "params changed although the step failed"
        for text in expected:
            assert text in message, message


def _swap_equal_buckets_on_rank_1(engine, rank):
    """Rank 1 reduces the buckets of two equally laid out flat groups (two
    blocks' params, stage 3) in the other order."""
    if rank != 1:
        return
    groups = list(engine.parts.reducer.groups)
    i, j = next((i, j) for i in range(len(groups)) for j in range(i + 1, len(groups))
                if [b.numel for b in groups[i].buckets] == [b.numel for b in groups[j].buckets])
    groups[i], groups[j] = groups[j], groups[i]
    engine.parts.reducer.order(groups)


def _retag_on_rank_1(engine, rank):
    """Rank 1 reduces its one trainable group (stage 2) under another key
    (its other collectives keep theirs)."""
    if rank == 1:
        group = engine.parts.reducer.groups[0]
        group.tag += 100
        engine.parts.reducer.order(engine.parts.reducer.groups)  # the native reducer takes the tag now
        group.tag -= 100


@pytest.mark.parametrize("stage,tamper", [(3, _swap_equal_buckets_on_rank_1), (2, _retag_on_rank_1)])
def test_injected_bucket_mismatch_raises_on_every_rank(stage, tamper):
    results = run_ranks(_train_one_step, 2, make, stage, tamper, timeout=60)
    _assert_raised_everywhere(results, "reduce_scatter of", "rank 0:", "rank 1:", "Nothing was updated")


def _diverge_late(rank, world):
    """Rank 1 swaps two equal buckets after more collectives than the
    traces keep (the data queue's 3, the reductions' queue's none)."""
    model = make()
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"stage": 3, "bucket_bytes": 1024})
    engine.parts.comm.TRACE_LIMIT = 3
    engine.parts.reduce_comm.TRACE_LIMIT = 0
    _swap_equal_buckets_on_rank_1(engine, rank)
    x, y = lm_batch(0, 0, world)
    with torch.no_grad():
        for _ in range(5):  # eval forwards between steps: their gathers count, their trace stays bounded
            engine(local(x, rank, world))
    assert len(engine.parts.comm.trace) == 3
    engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    with pytest.raises(zerocore.CollectiveOrderError, match="after the first 3, which agree"):
        engine.step()
    return len(engine.parts.comm.trace)


def test_trace_is_bounded_and_divergence_past_it_still_raises():
    assert run_ranks(_diverge_late, 2, timeout=60) == [0, 0]
