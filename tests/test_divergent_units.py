"""Stage 3 with ranks that run different units: experts chosen by the data,
each its own unit by default, trained with no annotation. Each rank runs the
experts its samples route to (none, some, one twice); the engine must equal
single-process torch and stage 2 on the same global batch, and never hang."""
import functools
import gc

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zerocore
from backend_bytes import assert_report_is_the_backends
from dist_harness import run_ranks
from models import DIM, VOCAB, Block, assert_state_close, engine_train, lm_batch, lm_loss, make, reference_train

EXPERTS = 3
STEPS = 3


class MoEBlock(nn.Module):
    """Each sample's route code picks what the block does: -1 nothing (the
    residual only), e < EXPERTS expert e, EXPERTS + e expert e twice."""

    def __init__(self, checkpointing=None):
        super().__init__()
        self.experts = nn.ModuleList(Block() for _ in range(EXPERTS))
        self.checkpointing = checkpointing

    def _run(self, expert, x):
        if self.checkpointing is None:
            return expert(x)
        return checkpoint(expert, x, use_reentrant=self.checkpointing == "reentrant")

    def forward(self, x, codes):
        out = x
        for e, expert in enumerate(self.experts):
            once = (codes == e).nonzero().flatten()
            if once.numel():
                out = out.index_add(0, once, self._run(expert, x[once]))
            twice = (codes == EXPERTS + e).nonzero().flatten()
            if twice.numel():
                out = out.index_add(0, twice, self._run(expert, self._run(expert, x[twice])))
        return out


class DataRouted(nn.Module):
    """Block l routes each sample by its token at position l: code = token - 1."""

    def __init__(self, layers=2, checkpointing=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MoEBlock(checkpointing) for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for layer, block in enumerate(self.blocks):
            x = block(x, idx[:, layer] - 1)
        return self.head(x)


def routed(codes_of):
    """A batch function whose samples on rank r, in step s and micro-batch m,
    take the route codes codes_of(r, s, m, layer) (one per local sample)."""

    def batch(step, micro, world):
        x, y = lm_batch(step, micro, world)
        per_rank = x.shape[0] // world
        for r in range(world):
            for layer in range(2):
                codes = torch.as_tensor(codes_of(r, step, micro, layer), dtype=x.dtype).expand(per_rank)
                x[r * per_rank:(r + 1) * per_rank, layer] = codes + 1
        return x, y

    return batch


def random_codes(r, step, micro, layer, low=-1):
    """Fresh random routes per rank, step, micro-batch and layer (skips included)."""
    g = torch.Generator().manual_seed(7919 * r + 104729 * step + 31 * micro + layer)
    return torch.randint(low, EXPERTS, (2,), generator=g)


def _train(rank, world, model_fn, batch, accum, stages):
    out = {}
    backend = zerocore._native.process_backend()
    for stage in stages:
        model = model_fn()
        gc.collect()  # nothing of an earlier engine is freed while this one is measured
        before = backend.allocated_bytes()
        engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1),
                               {"stage": stage, "bucket_bytes": 512})
        out[stage] = engine_train(engine, rank, world, STEPS, accum, batch=batch)
        # Stage 3's pool may have grown (units some ranks needed at once): the report still says what is held.
        held = {kind: n - before[kind] for kind, n in backend.allocated_bytes().items()}
        out[f"stage {stage} memory"] = engine.memory_report(), held
        if stage == 3:
            out["experts are units"] = sum(isinstance(u.modules[0], Block) for u in engine.parts.units)
        engine.close()
    return out


def _reference(model_fn, batch, world, accum, dtype):
    model = model_fn().to(dtype)
    return reference_train(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), STEPS, accum,
                           world, batch=batch)


def assert_as_close_as_torch(got, ref64, ref32, initial, what):
    """Each param of `got` (an fp32 engine's) no further from float64 torch
    than 4x single-process fp32 torch is, plus 1e-5 of the param's movement:
    where few samples reach an expert, Adam amplifies fp32 rounding into a
    share of the movement of up to 5e-4 for torch itself (measured), while a
    lost, doubled or misrouted grad misses by a share of order 1."""
    for k in ref64:
        off = float((got[k].double() - ref64[k]).norm())
        torch_off = float((ref32[k].double() - ref64[k]).norm())
        moved = float((ref64[k] - initial[k].double()).norm())
        assert off <= 4 * torch_off + 1e-5 * moved + 1e-7, (
            f"{what} {k}: {off:.3g} from float64 torch, fp32 torch {torch_off:.3g}, movement {moved:.3g}")


def check(model_fn, batch, world=2, accum=1):
    """Stages 2 and 3 on `world` ranks against one process on the global
    batch (float64, with fp32's own distance from it as the yardstick), and
    stage 3 against stage 2 (no units) closely."""
    results = run_ranks(_train, world, model_fn, batch, accum, (2, 3), timeout=90)
    initial = model_fn().state_dict()
    ref64, ref32 = (_reference(model_fn, batch, world, accum, dtype) for dtype in (torch.float64, torch.float32))
    for rank, result in enumerate(results):
        assert result["experts are units"] == 2 * EXPERTS  # DataRouted's 2 layers; no units= given: the default
        for stage in (2, 3):
            assert_as_close_as_torch(result[stage], ref64, ref32, initial, what=f"stage {stage} rank {rank}")
            assert_report_is_the_backends(*result[f"stage {stage} memory"], what=f"stage {stage} rank {rank}")
        assert_state_close(result[3], result[2], rtol=1e-5, atol=1e-6, what=f"stage 3 vs stage 2, rank {rank}")


@pytest.mark.parametrize("world", [2, 4])
def test_experts_chosen_by_data(world):
    check(functools.partial(make, DataRouted), routed(random_codes), world)


@pytest.mark.parametrize("world", [2, 4])
def test_one_expert_per_rank(world):
    """Every rank runs a different expert of each layer, the same number of times."""
    check(functools.partial(make, DataRouted), routed(lambda r, s, m, layer: r % EXPERTS), world)


def test_a_rank_skipping_a_whole_layers_experts():
    skip_first = lambda r, s, m, layer: -1 if r == 1 and layer == 0 else random_codes(r, s, m, layer, low=0)  # noqa: E731
    check(functools.partial(make, DataRouted), routed(skip_first), world=4)


def test_an_expert_run_twice_on_one_rank_only():
    twice = lambda r, s, m, layer: EXPERTS + 1 if r == 0 else random_codes(r, s, m, layer)  # noqa: E731
    check(functools.partial(make, DataRouted), routed(twice), world=2)


def test_accumulation_with_routes_changing_per_micro_batch():
    check(functools.partial(make, DataRouted), routed(random_codes), world=2, accum=3)


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_checkpointing_inside_experts(mode):
    twice = lambda r, s, m, layer: EXPERTS if r == 1 else random_codes(r, s, m, layer)  # noqa: E731
    check(functools.partial(make, DataRouted, checkpointing=mode), routed(twice), world=2)


# Cost and failure -----------------------------------------------------------

def _blocking_rounds_per_step(rank, world, layers):
    model = make(layers=layers)
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"stage": 3})
    x, y = lm_batch(0, 0, world)
    counts = []
    for _ in range(3):
        before = engine.parts.scheduler.native.blocking_rounds
        engine.backward(lm_loss(engine(x.chunk(world)[rank]), y.chunk(world)[rank]))
        engine.step()
        counts.append(engine.parts.scheduler.native.blocking_rounds - before)
    return counts


@pytest.mark.parametrize("layers", [2, 6])
def test_a_dense_model_waits_for_few_rounds(layers):
    """Every unit hook posts a round that the next hook settles, while the
    unit computes: once the previous step's order is known, only the end of
    the backward is waited for at once, however many units there are (and
    the end of the forward, when a rank gets there first); the step's own
    round, which gathers what the next forward starts with, rides on the
    step's exchange."""
    for counts in run_ranks(_blocking_rounds_per_step, 2, layers):
        assert all(1 <= c <= 2 for c in counts[1:]), counts


class FailsOnRank1(DataRouted):
    def forward(self, idx):
        x = self.blocks[0](self.embed(idx), idx[:, 0] - 1)
        if torch.distributed.get_rank() == 1:
            raise ValueError("rank 1's forward failed")
        return self.head(self.blocks[1](x, idx[:, 1] - 1))


def _fail(rank, world):
    model = make(FailsOnRank1)
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"stage": 3})
    x, y = routed(random_codes)(0, 0, world)
    try:
        engine(x.chunk(world)[rank])
    except (ValueError, RuntimeError) as e:
        first = f"{type(e).__name__}: {e}"
    else:
        first = None
    # Every rank stopped at the same point: the engine trains on afterwards.
    model.forward = functools.partial(DataRouted.forward, model)
    engine.backward(lm_loss(engine(x.chunk(world)[rank]), y.chunk(world)[rank]))
    engine.step()
    return first, engine.full_state_dict()


def test_a_forward_failing_on_one_rank_raises_on_every_rank():
    results = run_ranks(_fail, 2, timeout=60)
    first = [r[0] for r in results]
    assert first[1] == "ValueError: rank 1's forward failed"
    assert first[0].startswith("RuntimeError: zerocore: 1 other rank(s) failed during this forward"), first[0]
    # The step after the failure is the first step of single-process torch on the same batch.
    model = make(DataRouted)
    ref = reference_train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), 1, 1, 2, batch=routed(random_codes))
    for rank, (_, state) in enumerate(results):
        assert_state_close(state, ref, rtol=1e-5, atol=1e-6, what=f"rank {rank} after the failed forward")
