"""The model shapes users bring, each trained with every stage on 2 ranks and
compared with single-process PyTorch on the same global batch."""
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zerocore
from dist_harness import run_ranks
from models import (DIM, VOCAB, Block, LateGrads, TinyLM, assert_state_close, engine_train, lm_batch, lm_loss, make,
                    reference_train)

STAGES = (0, 1, 2, 3)
STEPS = 4


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def _train_stages(rank, world, model_fn, opt_fn, config, forward, steps, accum, sched_fn):
    out = {}
    for stage in STAGES:
        model = model_fn()
        engine = zerocore.wrap(model, opt_fn([p for p in model.parameters() if p.requires_grad]),
                               dict(config, stage=stage))
        scheduler = sched_fn(engine.optimizer) if sched_fn else None
        out[stage] = engine_train(engine, rank, world, steps, accum, forward=forward, scheduler=scheduler)
    return out


def check_against_reference(model_fn, *, opt_fn=adamw, config=None, forward=None, steps=STEPS, accum=1,
                            world=2, sched_fn=None, rtol=1e-5, atol=1e-6):
    """Trains every stage on `world` ranks and the reference on one process;
    returns the engines' state dicts for further checks."""
    results = run_ranks(_train_stages, world, model_fn, opt_fn, config or {"bucket_bytes": 512},
                        forward and (lambda e, x, step: forward(e, x, step)), steps, accum, sched_fn, timeout=60)
    model = model_fn()
    opt = opt_fn([p for p in model.parameters() if p.requires_grad])
    ref = reference_train(model, opt, steps, accum, world, forward=forward and (lambda m, x, s: forward(m, x, s)),
                          scheduler=sched_fn(opt) if sched_fn else None)
    for stage in STAGES:
        for rank in range(world):
            assert_state_close(results[rank][stage], ref, rtol=rtol, atol=atol, what=f"stage {stage} rank {rank}")
    return results


# Shapes --------------------------------------------------------------------

class CrossUnitTie(TinyLM):
    """A weight shared by two units (blocks), not only by root modules."""

    def __init__(self):
        super().__init__(layers=2, tied=False)
        self.blocks[1].up.weight = self.blocks[0].up.weight


def test_weights_tied_within_root_and_across_units():
    check_against_reference(functools.partial(make, TinyLM, tied=True))
    results = check_against_reference(functools.partial(make, CrossUnitTie))
    sd = results[0][3]
    assert torch.equal(sd["blocks.0.up.weight"], sd["blocks.1.up.weight"])


def frozen_embedding():
    m = make(TinyLM, tied=False)
    m.embed.weight.requires_grad_(False)
    return m


def test_frozen_params_stay_put_and_others_train():
    results = check_against_reference(frozen_embedding)
    start = frozen_embedding().state_dict()["embed.weight"]
    for stage in STAGES:
        assert torch.equal(results[0][stage]["embed.weight"], start)


class SometimesUnused(TinyLM):
    """An extra projection used on even steps only."""

    def __init__(self):
        super().__init__(layers=2)
        self.extra = nn.Linear(DIM, DIM)

    def forward(self, idx, use_extra=False):
        x = self.embed(idx)
        if use_extra:
            x = self.extra(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def test_params_unused_in_some_steps():
    check_against_reference(functools.partial(make, SometimesUnused),
                            forward=lambda m, x, step: m(x, use_extra=step % 2 == 0))


class CalledTwice(TinyLM):
    def forward(self, idx):
        x = self.embed(idx)
        x = self.blocks[0](self.blocks[0](x))  # one module, two calls
        return self.head(self.norm(self.blocks[1](x)))


def test_module_called_twice_in_one_forward():
    check_against_reference(functools.partial(make, CalledTwice))


class Nested(nn.Module):
    """Blocks that hold their own ModuleList of sub-blocks."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.stages = nn.ModuleList(nn.ModuleDict({"inner": nn.ModuleList([Block(), Block()]),
                                                   "norm": nn.LayerNorm(DIM)}) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for stage in self.stages:
            for b in stage["inner"]:
                x = b(x)
            x = stage["norm"](x)
        return self.head(x)


def test_nested_modules():
    check_against_reference(functools.partial(make, Nested))


class Checkpointed(TinyLM):
    def __init__(self, reentrant):
        super().__init__(layers=2)
        self.reentrant = reentrant

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant)
        return self.head(self.norm(x))


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant):
    check_against_reference(functools.partial(make, Checkpointed, reentrant=reentrant))


def test_late_grads_over_accumulated_backwards():
    """A param's second grad after its buckets were reduced (models.LateGrads),
    in each of two accumulated backwards: the first's rides along with the
    second's reduction, the second's is reduced in the step's exchange
    (test_host_waits counts its second exchange)."""
    check_against_reference(functools.partial(make, LateGrads), accum=2)


class LoRALinear(nn.Module):
    """A frozen base weight plus a trainable low-rank update (adapter
    fine-tuning): input grads need the frozen weight after the trainable
    ones have their grads."""

    def __init__(self, d_in, d_out, rank=4):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, d_in) / d_in ** 0.5)
        self.b = nn.Parameter(torch.randn(d_out, rank) / rank)

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


class Adapters(TinyLM):
    """Every block's linears are LoRA adapters over frozen weights and the
    rest of the block is frozen too, each block a stage-3 unit, optionally
    checkpointed."""

    def __init__(self, checkpointing=None):
        super().__init__(layers=3)
        for b in self.blocks:
            b.norm.requires_grad_(False)
            b.up, b.down = LoRALinear(DIM, 2 * DIM), LoRALinear(2 * DIM, DIM)
        self.checkpointing = checkpointing

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.blocks:
            if self.checkpointing is None:
                x = b(x)
            else:
                x = checkpoint(b, x, use_reentrant=self.checkpointing == "reentrant")
        return self.head(self.norm(x))


@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non-reentrant"])
def test_adapters_over_frozen_weights_in_one_unit(checkpointing):
    results = check_against_reference(functools.partial(make, Adapters, checkpointing=checkpointing))
    frozen = make(Adapters).state_dict()
    for stage in STAGES:
        for name, value in results[0][stage].items():
            if name.startswith("blocks.") and not name.endswith((".a", ".b")):
                assert torch.equal(value, frozen[name]), (stage, name)


def _gathered_during_backward(rank, world):
    """At the start of each block's backward, how many other units are gathered."""
    model = make(Adapters)
    engine = zerocore.wrap(model, adamw([p for p in model.parameters() if p.requires_grad]),
                           {"stage": 3, "prefetch_bytes": 0})
    seen = []
    for b in model.blocks:
        b.register_full_backward_pre_hook(
            lambda m, g: seen.append(sum(u.gathered for u in engine.parts.units if m not in u.modules)))
    x, y = lm_batch(0, 0, world)
    engine.backward(lm_loss(engine(x.chunk(world)[rank]), y.chunk(world)[rank]))
    return seen, sum(u.gathered for u in engine.parts.units), engine.parts.scheduler.native.pool_slots


def test_stage3_releases_each_unit_at_its_post_backward_point():
    for seen, after, slots in run_ranks(_gathered_during_backward, 2):
        # Only the root (its inputs need no grad, so it stays until backward
        # ends): the blocks whose backward is done were released, and the
        # pool's one slot (no prefetch) never had to grow.
        assert seen == [1, 1, 1], seen
        assert slots == 1
        assert after == 0


def test_calling_the_module_itself_trains_the_same():
    """A user who calls the wrapped module rather than the engine: stage 3's
    saved views of params still follow their units into whichever pool slot
    backward gathers them in (two blocks, prefetch: they change slots)."""
    direct = lambda m, x, step: (m.module if isinstance(m, zerocore.Engine) else m)(x)  # noqa: E731
    check_against_reference(make, forward=direct)


def _nested_units(rank, world):
    """Blocks and every Linear as units of their own: a block stays gathered
    while its inner units gather (more units in use at once than the planned
    pool holds), and the head, a unit, shares its weight with the root's
    embedding (so the root owns it)."""
    model = make()
    engine = zerocore.wrap(model, adamw(model.parameters()), {"stage": 3, "prefetch_bytes": 0},
                           units=[Block, nn.Linear])
    planned = engine.parts.scheduler.native.pool_slots
    state = engine_train(engine, rank, world, STEPS, 1)
    return state, planned, engine.parts.scheduler.native.pool_slots, len(engine.parts.units)


def test_nested_units_train_the_same_and_grow_the_pool_once():
    results = run_ranks(_nested_units, 2)
    model = make()
    ref = reference_train(model, adamw(model.parameters()), STEPS, 1, 2)
    for state, planned, slots, units in results:
        assert units == 1 + 2 * 3 + 1  # root; per block: the block, up, down; the head (tied to the root's embedding)
        assert_state_close(state, ref, rtol=1e-5, atol=1e-6, what="nested units")
        assert planned == 1 and slots == 2  # a block and its inner Linear at once


class DictOutput(TinyLM):
    def forward(self, idx):
        logits = super().forward(idx)
        return {"logits": logits, "extras": (logits.mean(), [logits.shape[0]])}


def test_dict_and_tuple_outputs():
    check_against_reference(functools.partial(make, DictOutput), forward=lambda m, x, step: m(x)["logits"])


class MoEBlock(nn.Module):
    """Mixture of experts: each sample picks an expert from its first token,
    so ranks (holding different samples) take different paths inside it."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x, choice):
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]))
        return out


class Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for blk in self.blocks:
            x = blk(x, idx[:, 0] % 3)
        return self.head(x)


def routed_batch(step, micro, world):
    # Rank 0's samples use expert 0 only, rank 1's experts 1 and 2.
    x, y = lm_batch(step, micro, world)
    x[: x.shape[0] // world, 0] = 3 * torch.arange(x.shape[0] // world)
    x[x.shape[0] // world:, 0] = 1 + torch.arange(x.shape[0] - x.shape[0] // world) % 2
    return x, y


def test_ranks_taking_different_paths_inside_a_unit():
    results = run_ranks(_train_routed, 2, timeout=120)
    model = make(Routed)
    ref = reference_train(model, adamw(model.parameters()), STEPS, 1, 2, batch=routed_batch)
    for stage in STAGES:
        assert_state_close(results[0][stage], ref, rtol=1e-5, atol=1e-6, what=f"stage {stage}")


def _train_routed(rank, world):
    out = {}
    for stage in STAGES:
        model = make(Routed)
        engine = zerocore.wrap(model, adamw(model.parameters()), dict(stage=stage, bucket_bytes=512))
        out[stage] = engine_train(engine, rank, world, STEPS, 1, batch=routed_batch)
    return out


class Reordered(TinyLM):
    """The blocks run in the opposite order on odd steps."""

    def forward(self, idx, flip=False):
        x = self.embed(idx)
        for b in (reversed(self.blocks) if flip else self.blocks):
            x = b(x)
        return self.head(self.norm(x))


def test_unit_order_changing_between_steps():
    check_against_reference(functools.partial(make, Reordered, layers=3), config={"bucket_bytes": 512,
                            "prefetch_bytes": 1 << 20}, forward=lambda m, x, step: m(x, flip=step % 2 == 1),
                            steps=5)


# Optimizers, schedules, clipping ------------------------------------------

def two_groups(params):
    params = list(params)
    return torch.optim.AdamW([{"params": params[::2], "lr": 3e-3, "weight_decay": 0.0},
                              {"params": params[1::2]}], lr=1e-3, weight_decay=0.2)


def test_param_groups_keep_their_hyperparameters():
    check_against_reference(functools.partial(make, TinyLM, tied=False), opt_fn=two_groups)


@pytest.mark.parametrize("opt_fn,reference_opt", [
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.05), None),
    (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3), None),
    (lambda ps: torch.optim.SGD(ps, lr=0.05), None),
    # zerocore's own AdamW, whose defaults are torch's: trained as torch's AdamW.
    (lambda ps: zerocore.AdamW(ps, lr=1e-3), lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
], ids=["adam", "sgd-nesterov", "sgd", "zerocore-adamw"])
def test_other_optimizers(opt_fn, reference_opt):
    results = run_ranks(_train_stages, 2, make, opt_fn, {"bucket_bytes": 512}, None, STEPS, 1, None)
    model = make()
    ref = reference_train(model, (reference_opt or opt_fn)(model.parameters()), STEPS, 1, 2)
    for stage in STAGES:
        for rank in range(2):
            assert_state_close(results[rank][stage], ref, rtol=1e-5, atol=1e-6, what=f"stage {stage} rank {rank}")


def test_lr_scheduler_drives_engine_optimizer():
    check_against_reference(make, sched_fn=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))


def test_gradient_clipping_by_global_norm():
    results = run_ranks(_train_stages, 2, make, adamw, {"bucket_bytes": 512, "max_grad_norm": 0.05}, None,
                        STEPS, 2, None)
    model = make()
    opt = adamw(model.parameters())

    class Clipped:
        def step(self):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()

        def zero_grad(self):
            opt.zero_grad()

    ref = reference_train(model, Clipped(), STEPS, 2, 2)
    for stage in STAGES:
        assert_state_close(results[0][stage], ref, rtol=1e-5, atol=1e-6, what=f"stage {stage}")


# Buffers, eval, no_grad ----------------------------------------------------

class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(x))


def _buffers_follow_rank_0(rank, world):
    out = {}
    for stage in STAGES:
        model = make(WithBatchNorm)
        engine = zerocore.wrap(model, adamw(model.parameters()), dict(stage=stage))
        model.bn.running_mean.fill_(float(rank))  # ranks drift apart...
        model.eval()
        y = engine(torch.ones(2, 4))  # ...and forward takes rank 0's again, as DDP does
        out[stage] = (model.bn.running_mean.clone(), y.detach(), engine.full_state_dict()["bn.running_mean"])
    return out


def test_buffers_are_kept_in_sync_from_rank_0():
    results = run_ranks(_buffers_follow_rank_0, 2)
    for stage in STAGES:
        for rank in range(2):
            mean, y, sd_mean = results[rank][stage]
            assert torch.equal(mean, torch.zeros(4)) and torch.equal(sd_mean, torch.zeros(4))
            assert torch.equal(y, results[0][stage][1])


def _eval_frees(rank, world):
    model = make()
    engine = zerocore.wrap(model, adamw(model.parameters()), dict(stage=3))
    at_rest = engine.memory_report()["param"]
    x, _ = lm_batch(0, 0, world)
    model.eval()
    with torch.no_grad():
        y = engine(x)
    after = engine.memory_report()["param"]
    with engine.gathered_params():
        full = {k: v.clone() for k, v in model.state_dict().items()}
    return y, at_rest, after, full, [g.binder.bound is not None for g in engine.parts.groups]


def test_no_grad_eval_forward_frees_stage3_params():
    results = run_ranks(_eval_frees, 2)
    ref_model = make()
    ref = ref_model(lm_batch(0, 0, 2)[0])
    for y, at_rest, after, full, gathered in results:
        assert after == at_rest and not any(gathered)
        torch.testing.assert_close(y, ref.detach(), rtol=1e-6, atol=1e-6)
        assert_state_close(full, ref_model.state_dict(), rtol=0, atol=0, what="gathered params")


def _edit_inside_gathered(rank, world):
    model = make()
    engine = zerocore.wrap(model, adamw(model.parameters()), dict(stage=3, dtype="bf16"))
    with engine.gathered_params(), torch.no_grad():
        model.head.weight.mul_(0)  # tied: the embedding too
        model.blocks[0].up.bias.fill_(0.5)
    return engine.full_state_dict()


def test_edits_inside_gathered_params_are_kept():
    sd = run_ranks(_edit_inside_gathered, 2)[1]
    assert torch.equal(sd["embed.weight"], torch.zeros(VOCAB, DIM))
    assert torch.equal(sd["blocks.0.up.bias"], torch.full((2 * DIM,), 0.5))
    # Untouched params keep their fp32 master values, not a bf16 rounding.
    assert torch.equal(sd["blocks.1.up.weight"], make().state_dict()["blocks.1.up.weight"])
