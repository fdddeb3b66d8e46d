"""The order contract: ranks that issue different collectives (another unit,
bucket or order) get CollectiveOrderError on every rank, naming where they
parted, with nothing updated; never silently mispaired data."""
import pytest
import torch
from torch import nn

import zerocore
from dist_harness import run_ranks
from models import DIM, VOCAB, Block, TinyLM, lm_batch, lm_loss, local, make


class OneExpertPerRank(nn.Module):
    """Each rank's batch is routed, by its data, to one of three experts, each
    expert its own stage-3 unit: ranks with different data gather different
    units of the same size, the same number of times."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.experts = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        return self.head(self.experts[int(idx[0, 0]) % 3](self.embed(idx)))


def _train_one_step(rank, world, model_fn, stage, tamper=None, batch_fn=None):
    model = model_fn()
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           {"stage": stage, "bucket_bytes": 1024})
    if tamper:
        tamper(engine, rank)
    before = engine.full_state_dict()
    x, y = (batch_fn or lm_batch)(0, 0, world)
    engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    try:
        engine.step()
    except zerocore.CollectiveOrderError as e:
        after = engine.full_state_dict()
        return str(e), all(torch.equal(before[k], after[k]) for k in before)
    return None, None


def _routed_batch(step, micro, world):
    x, y = lm_batch(step, micro, world)
    x[:, 0] = torch.arange(world).repeat_interleave(x.shape[0] // world)  # rank r routes to expert r
    return x, y


def _assert_raised_everywhere(results, *expected):
    for message, unchanged in results:
        assert message is not None, "no CollectiveOrderError"
        assert unchanged, "params changed although the step failed"
        for text in expected:
            assert text in message, message


def test_experts_as_separate_units_chosen_by_data_raise_on_every_rank():
    results = run_ranks(_train_one_step, 2, lambda: make(OneExpertPerRank), 3, None, _routed_batch, timeout=60)
    _assert_raised_everywhere(results, "rank 0: all_gather of the params experts.0.", "rank 1: all_gather of the "
                              "params experts.1.", "units=")


def test_same_route_on_every_rank_trains():
    same = lambda step, micro, world: _routed_batch(step, micro, 1)  # noqa: E731 - every rank takes expert 0
    results = run_ranks(_train_one_step, 2, lambda: make(OneExpertPerRank), 3, None, same, timeout=60)
    assert results == [(None, None)] * 2


class SwappedOnRank1(TinyLM):
    """Rank 1 runs its (equally sized) blocks in the other order."""

    def forward(self, idx):
        x = self.embed(idx)
        blocks = self.blocks[::-1] if torch.distributed.get_rank() == 1 else self.blocks
        for b in blocks:
            x = b(x)
        return self.head(self.norm(x))


def test_injected_unit_order_mismatch_raises_on_every_rank():
    results = run_ranks(_train_one_step, 2, lambda: make(SwappedOnRank1), 3, timeout=60)
    _assert_raised_everywhere(results, "rank 0: all_gather of the params blocks.0.", "rank 1: all_gather of the "
                              "params blocks.1.")


def _swap_equal_buckets_on_rank_1(engine, rank):
    """Rank 1 reduces the buckets of two equally laid out flat groups (two
    blocks' params, stage 3) in the other order."""
    if rank != 1:
        return
    groups = list(engine.reducer.groups)
    i, j = next((i, j) for i in range(len(groups)) for j in range(i + 1, len(groups))
                if [b.numel for b in groups[i].buckets] == [b.numel for b in groups[j].buckets])
    groups[i], groups[j] = groups[j], groups[i]
    engine.reducer.order(groups)


def _retag_on_rank_1(engine, rank):
    """Rank 1 reduces its one trainable group (stage 2) under another key
    (its other collectives keep theirs)."""
    if rank == 1:
        group = engine.reducer.groups[0]
        group.tag += 100
        engine.reducer.order(engine.reducer.groups)  # the native reducer takes the tag now
        group.tag -= 100


@pytest.mark.parametrize("stage,tamper", [(3, _swap_equal_buckets_on_rank_1), (2, _retag_on_rank_1)])
def test_injected_bucket_mismatch_raises_on_every_rank(stage, tamper):
    results = run_ranks(_train_one_step, 2, make, stage, tamper, timeout=60)
    _assert_raised_everywhere(results, "reduce_scatter of", "rank 0:", "rank 1:", "Nothing was updated")


def _diverge_late(rank, world):
    """Rank 1 swaps two equal buckets after more collectives than the trace keeps."""
    model = make()
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"stage": 3, "bucket_bytes": 1024})
    engine.comm.TRACE_LIMIT = 3
    _swap_equal_buckets_on_rank_1(engine, rank)
    x, y = lm_batch(0, 0, world)
    with torch.no_grad():
        for _ in range(5):  # eval forwards between steps: their gathers count, their trace stays bounded
            engine(local(x, rank, world))
    assert len(engine.comm.trace) == 3
    engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    with pytest.raises(zerocore.CollectiveOrderError, match="after the first 3, which agree"):
        engine.step()
    return len(engine.comm.trace)


def test_trace_is_bounded_and_divergence_past_it_still_raises():
    assert run_ranks(_diverge_late, 2, timeout=60) == [0, 0]
