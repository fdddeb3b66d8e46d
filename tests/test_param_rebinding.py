"""Rebinding a param's .data after zerocore.wrap (`p.data = t`), a torch
user's habit: where params are held whole it reaches training as the same
in-place write would (against single-process torch doing the same); on a
released stage-3 param it raises on the calling rank, naming what to do,
and the other ranks train on."""
import contextlib

import pytest
import torch

import zerocore
from dist_harness import run_ranks
from models import assert_state_close, lm_batch, lm_loss, local, make

STEPS = 3  # the rebinding comes after the first


def sgd(params):
    return torch.optim.SGD(params, lr=0.2)


def _new_values(gen):
    """Values to rebind some params to: one of a tied pair (set through
    the head, read through the embedding too), a weight given as a
    transposed (non-contiguous) tensor, a bias."""
    model = make()
    shapes = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}
    return {"head.weight": torch.randn(shapes["head.weight"], generator=gen),
            "blocks.1.down.weight": torch.randn(shapes["blocks.1.down.weight"][::-1], generator=gen).t(),
            "blocks.0.up.bias": torch.randn(shapes["blocks.0.up.bias"], generator=gen)}


def _write(model, new, how):
    """how: "data" rebinds the params to `new`'s tensors in the params'
    dtype (16-bit where the engine trains in it), "copy_" writes their
    values in place."""
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, t in new.items():
            if how == "data":
                params[name].data = t.to(params[name].dtype, copy=True)
            else:
                params[name].copy_(t)


def _train(rank, world, config, new, writers, how):
    """STEPS steps; after the first, the ranks in `writers` write `new`."""
    model = make()
    engine = zerocore.wrap(model, sgd(model.parameters()), zerocore.Config(bucket_bytes=512, **config))
    for step in range(STEPS):
        if step == 1 and rank in writers:
            sharded = config["stage"] == 3 and not config.get("persist_threshold")
            with engine.gathered_params() if sharded else contextlib.nullcontext():
                _write(model, new, how)
        x, y = lm_batch(step, 0, world)
        engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
        engine.step()
        engine.zero_grad()
    with engine.gathered_params():
        module = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return engine.full_state_dict(), module


def _torch_reference(new, writers, world):
    """What torch gives, DDP's way: each rank's replica trains on its part
    of the batch with the grads averaged over ranks; after the first step
    the replicas of `writers` have `new` set."""
    models = [make() for _ in range(world)]
    opts = [sgd(m.parameters()) for m in models]
    for step in range(STEPS):
        if step == 1:
            for r in writers:
                _write(models[r], new, "data")
        x, y = lm_batch(step, 0, world)
        for r, m in enumerate(models):
            lm_loss(m(local(x, r, world)), local(y, r, world)).backward()
        for replicas in zip(*(m.parameters() for m in models)):
            mean = sum(p.grad for p in replicas) / world
            for p in replicas:
                p.grad = mean.clone()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]


def _assert_module_holds(module, state, what):
    """The module trains on what the engine holds (in the dtype it trains
    in), not on the tensors its params were rebound to."""
    assert_state_close(module, {k: v.to(module[k].dtype) for k, v in state.items()}, rtol=0, atol=0, what=what)


WHOLE = [{"stage": 0}, {"stage": 1}, {"stage": 2}, {"stage": 2, "offload_optimizer": "cpu"},
         {"stage": 3, "persist_threshold": 10**6}]
CONFIG_ID = lambda c: "-".join(f"{v}" for v in c.values())  # noqa: E731


@pytest.mark.parametrize("config", WHOLE + [{"stage": 3}], ids=CONFIG_ID)
def test_a_rebinding_on_every_rank_trains_as_torch(config, gen):
    """Stage 3's sharded params are rebound inside engine.gathered_params()."""
    new = _new_values(gen)
    ref = _torch_reference(new, (0, 1), 2)[0]
    for rank, (state, module) in enumerate(run_ranks(_train, 2, config, new, (0, 1), "data")):
        assert_state_close(state, ref, rtol=1e-5, atol=1e-5, what=f"rank {rank}: the engine's params")
        _assert_module_holds(module, state, f"rank {rank}: the module's params")


@pytest.mark.parametrize("config", WHOLE + [{"stage": 1, "dtype": "bf16"}], ids=CONFIG_ID)
def test_a_rebinding_on_one_rank_is_that_ranks_in_place_write(config, gen):
    """As with an in-place write, what reaches training is what the writing
    rank holds: at stage 0 its replica, as in DDP (against torch), at
    stages 1-2 the part of the param it updates (bitwise the in-place
    write's result)."""
    new = _new_values(gen)
    rebound = run_ranks(_train, 2, config, new, (1,), "data")
    written = run_ranks(_train, 2, config, new, (1,), "copy_")
    refs = _torch_reference(new, (1,), 2)
    for rank, ((state, module), (in_place, _), ref) in enumerate(zip(rebound, written, refs)):
        assert_state_close(state, in_place, rtol=0, atol=0, what=f"rank {rank}: against the in-place write")
        _assert_module_holds(module, state, f"rank {rank}: the module's params")
        if config == {"stage": 0}:
            assert_state_close(state, ref, rtol=1e-5, atol=1e-5, what=f"rank {rank}: against DDP")


def _rebind_to(rank, world, stage, tensor_of):
    """Rebinds blocks.0.up.weight to tensor_of(it) on every rank, between
    backward and the step (forward would fail on it first); returns the error."""
    model = make()
    engine = zerocore.wrap(model, sgd(model.parameters()), zerocore.Config(stage=stage, bucket_bytes=512))
    x, y = lm_batch(0, 0, world)
    p = model.blocks[0].up.weight
    engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    try:
        p.data = tensor_of(p.detach())
        engine.step()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_a_rebinding_to_another_shape_or_dtype_raises_naming_the_param(stage, change):
    tensor_of = (lambda t: t[:, :3]) if change == "shape" else (lambda t: t.double())
    for error in run_ranks(_rebind_to, 2, stage, tensor_of):
        assert error is not None and "blocks.0.up.weight.data was set to a tensor of" in error, error
        assert "engine.close()" in error


def _released(rank, world, callers, new):
    model = make()
    engine = zerocore.wrap(model, sgd(model.parameters()), zerocore.Config(stage=3, bucket_bytes=512))
    before = engine.full_state_dict()
    p = model.blocks[0].up.weight
    p.data = p.data  # rebinding a param to what it holds changes nothing, so it passes
    model.to(torch.float32)  # as does module.to() where it changes nothing (it sets each param's .data)
    error = None
    if rank in callers:
        try:
            p.data = new.clone()
        except RuntimeError as e:
            error = str(e)
    after = engine.full_state_dict()
    x, y = lm_batch(0, 0, world)
    engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    engine.step()  # the ranks train on together
    return error, before, after


@pytest.mark.parametrize("callers", [(0, 1), (0,)], ids=["every rank", "rank 0 only"])
def test_a_rebinding_of_a_released_stage3_param_raises_on_the_calling_rank(callers, gen):
    new = torch.randn(make().blocks[0].up.weight.shape, generator=gen)
    for rank, (error, before, after) in enumerate(run_ranks(_released, 2, callers, new)):
        if rank in callers:
            assert "the .data of blocks.0.up.weight, a stage-3 param that is released" in error, error
            assert "engine.gathered_params()" in error and "engine.load_state_dict" in error
        else:
            assert error is None
        assert_state_close(after, before, rtol=0, atol=0, what=f"rank {rank}: nothing changed")
