"""Stage 3's coalesced units: consecutive blocks of an nn.Sequential smaller
than the bucket size are gathered and reduced as one unit
(grouping.coalesce). Training must equal single-process torch whatever the
runs are, a step must issue the collectives the plan says, and units that
ranks run differently (experts) must stay correct beside coalesced ones."""
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zerocore
from dist_harness import run_ranks
from models import DIM, VOCAB, Block, assert_state_close, engine_train, lm_batch, make, reference_train
from test_divergent_units import MoEBlock, random_codes, routed

STEPS = 3
BLOCK_BYTES = sum(p.numel() for p in Block().parameters()) * 4  # one block's fp32 params


class CheckpointedBlock(Block):
    """Recomputed in backward: one module of a run runs on its own there."""

    def forward(self, x):
        return checkpoint(super().forward, x, use_reentrant=False)


class Chain(nn.Module):
    """Embedding, an nn.Sequential of blocks, head; `again` (or the forward's
    own `again`) calls block 1 once more after the Sequential, out of the
    run's order."""

    def __init__(self, layers=4, block=Block, again=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(*(block() for _ in range(layers)))
        self.head = nn.Linear(DIM, VOCAB)
        self.again = again

    def forward(self, idx, again=None):
        x = self.blocks(self.embed(idx))
        if self.again if again is None else again:
            x = self.blocks[1](x)
        return self.head(x)


class ChainThenExperts(nn.Module):
    """Dense blocks in an nn.Sequential (coalesced), then mixture-of-experts
    layers whose experts the data picks on each rank (units of their own)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.dense = nn.Sequential(Block(), Block(), Block())
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.dense(self.embed(idx))
        for layer, block in enumerate(self.blocks):
            x = block(x, idx[:, layer] - 1)
        return self.head(x)


def _train(rank, world, model_fn, config, batch, accum, forward):
    model = model_fn()
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1),
                           {"stage": 3, **config})
    state = engine_train(engine, rank, world, STEPS, accum, batch=batch,
                         forward=forward and functools.partial(forward, rank))
    return state, [len(u.modules) for u in engine.parts.units]


def check(model_fn, config, runs, batch=lm_batch, world=2, accum=1, forward=None, reference_forward=None):
    """Stage 3 on `world` ranks against one process on the global batch;
    `runs`: the modules of each unit, root first. forward(rank, engine, x,
    step) and reference_forward(model, x, step), when given, replace the
    plain calls."""
    results = run_ranks(_train, world, model_fn, config, batch, accum, forward, timeout=90)
    model = model_fn()
    ref = reference_train(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), STEPS, accum,
                          world, batch=batch, forward=reference_forward)
    for rank, (state, got_runs) in enumerate(results):
        assert got_runs == runs, (rank, got_runs)
        assert_state_close(state, ref, rtol=1e-5, atol=1e-6, what=f"rank {rank}")


@pytest.mark.parametrize("config, runs", [({}, [1, 4]),  # the default: bucket_bytes bounds a run
                                          ({"coalesce_bytes": 2 * BLOCK_BYTES}, [1, 2, 2]),
                                          ({"coalesce_bytes": 3 * BLOCK_BYTES}, [1, 3, 1]),
                                          ({"coalesce_bytes": 0}, [1, 1, 1, 1, 1])])
def test_coalesced_runs_train_as_torch(config, runs):
    check(functools.partial(make, Chain), config, runs, accum=2)


def test_a_module_of_a_run_called_again_out_of_order():
    check(functools.partial(make, Chain, again=True), {"coalesce_bytes": 2 * BLOCK_BYTES}, [1, 2, 2])


def _again_on_rank_0(rank, engine, x, step):
    return engine(x, again=rank == 0)


def _again_on_first_half(model, x, step):
    first, second = x.chunk(2)
    return torch.cat([model(first, again=True), model(second, again=False)])


def test_a_coalesced_unit_run_again_on_one_rank_only():
    """Ranks run the coalesced unit a different number of times."""
    check(functools.partial(make, Chain), {"coalesce_bytes": 2 * BLOCK_BYTES}, [1, 2, 2],
          forward=_again_on_rank_0, reference_forward=_again_on_first_half)


def test_recomputed_modules_of_a_run():
    check(functools.partial(make, Chain, block=CheckpointedBlock), {}, [1, 4])


@pytest.mark.parametrize("world", [2, 4])
def test_experts_chosen_by_data_beside_coalesced_blocks(world):
    # The root, the dense run, then each MoE layer and its experts: units of their own (the layers hold units)
    runs = [1, 3] + [1] * 2 * (1 + len(MoEBlock().experts))
    check(functools.partial(make, ChainThenExperts), {}, runs, batch=routed(random_codes), world=world)


def _collectives_a_step(rank, world, coalesce_bytes):
    model = make(Chain, layers=6)
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           {"stage": 3, "coalesce_bytes": coalesce_bytes})
    counts = []
    for step in range(3):
        x, _ = lm_batch(step, 0, world)
        rounds = engine.parts.scheduler.native.rounds
        engine.backward(engine(x.chunk(world)[rank]).square().mean())
        # Restarted at the step's order check: this step's gathers and reductions (on a queue of their own).
        data = len(engine.parts.comm.trace) + len(engine.parts.reduce_comm.trace)
        engine.step()
        engine.zero_grad()
        counts.append((data, engine.parts.scheduler.native.rounds - rounds))
    # The plan: each unit gathered for its forward and again for its
    # backward, one all-gather a bucket of each group, except the root,
    # gathered once; one reduce-scatter a bucket of each trainable group;
    # and the step's verdict on finite grads, summed over ranks (fp32: the
    # step decides on the device).
    buckets = [sum(len(g.buckets) for g in u.groups) for u in engine.parts.units]
    planned = buckets[0] + 2 * sum(buckets[1:]) + sum(len(g.buckets) for u in engine.parts.units for g in u.groups
                                                      if g.trainable) + 1
    return counts[1:], planned, len(engine.parts.units)


def test_collectives_a_step_are_the_plans():
    (coalesced, plan, units), _ = run_ranks(_collectives_a_step, 2, None)
    (single, single_plan, single_units), _ = run_ranks(_collectives_a_step, 2, 0)
    assert (units, single_units) == (2, 7)
    assert plan == 2 + 2 + 1 + 1  # the root: a gather and a reduction; the run: two gathers and a reduction; the verdict
    assert all(data == plan for data, _ in coalesced), coalesced
    assert all(data == single_plan for data, _ in single), single
    # A round per unit hook that needs params, and the passes' ends: fewer units, fewer rounds.
    assert max(r for _, r in coalesced) < min(r for _, r in single), (coalesced, single)
