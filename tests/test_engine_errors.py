"""Bad input gets a clear error naming the problem, on every rank, with
nothing a user had lost and no rank hung; fp16 overflow skips the step."""
import math
import re

import pytest
import torch

import zerocore
from zerocore import _native
from dist_harness import RankError, run_ranks
from models import TinyLM, lm_batch, lm_loss, local, make


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


# Single process, stage 0 (the only stage that needs no process group).

@pytest.mark.parametrize("config,match", [
    ({"stgae": 1}, "unknown key.*'stgae'"),
    ({"stage": 5}, "stage=5"),
    ({"dtype": "fp8"}, "dtype='fp8'"),
    ({"reduce_dtype": "int8"}, "reduce_dtype"),
    ({"loss_scale": -1}, "loss_scale"),
    ({"max_grad_norm": 0}, "max_grad_norm"),
    ({"bucket_bytes": 0}, "bucket_bytes"),
    ({"prefetch_bytes": -1}, "prefetch_bytes"),
    ({"persist_threshold": 1.5}, "persist_threshold"),
])
def test_bad_config_values(config, match):
    model = make()
    with pytest.raises(ValueError, match=match):
        zerocore.wrap(model, adamw(model), dict({"stage": 0}, **config))


def test_config_accepts_torch_dtypes_and_aliases():
    assert zerocore.Config(dtype=torch.bfloat16).dtype == "bf16"
    assert zerocore.Config(dtype="float16").reduce_dtype == "fp16"
    with pytest.raises(TypeError, match="Config or a dict"):
        zerocore.Config.from_any([("stage", 1)])


def test_partitioned_stage_without_process_group():
    model = make()
    with pytest.raises(ValueError, match="needs a process group.*init_process_group"):
        zerocore.wrap(model, adamw(model), {"stage": 2})


def test_non_module_and_wrapping_twice():
    model = make()
    with pytest.raises(TypeError, match="torch.nn.Module"):
        zerocore.wrap(lambda x: x, adamw(model), {"stage": 0})
    zerocore.wrap(model, adamw(model), {"stage": 0})
    with pytest.raises(ValueError, match="already wrapped"):
        zerocore.wrap(model, adamw(model), {"stage": 0})


def test_unsupported_optimizers():
    model = make()
    with pytest.raises(TypeError, match="RMSprop is not supported"):
        zerocore.wrap(model, torch.optim.RMSprop(model.parameters()), {"stage": 0})
    with pytest.raises(ValueError, match="amsgrad"):
        zerocore.wrap(model, torch.optim.Adam(model.parameters(), amsgrad=True), {"stage": 0})
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        zerocore.wrap(model, "adam", {"stage": 0})


def test_param_missing_from_optimizer():
    model = make()
    with pytest.raises(ValueError, match="head.weight|embed.weight.*not in the optimizer"):
        zerocore.wrap(model, torch.optim.AdamW(model.blocks.parameters()), {"stage": 0})


def test_step_before_backward():
    model = make()
    engine = zerocore.wrap(model, adamw(model), {"stage": 0})
    with pytest.raises(RuntimeError, match="call engine.backward"):
        engine.step()


def test_optimizer_state_dict_raises_instead_of_saving_nothing():
    model = make()
    engine = zerocore.wrap(model, adamw(model), {"stage": 0})
    with pytest.raises(NotImplementedError, match="would be empty"):
        engine.optimizer.state_dict()
    with pytest.raises(NotImplementedError, match="native buffers"):
        engine.optimizer.load_state_dict({})


# Across ranks.

def _mismatched(rank, world):
    model = make(TinyLM, layers=2 + rank)  # rank 1 has one more block
    zerocore.wrap(model, adamw(model), {"stage": 3})


def test_different_model_on_one_rank_fails_everywhere():
    results = run_ranks(_mismatched, 2, raise_errors=False, timeout=30)
    for r in results:
        assert isinstance(r, RankError) and r.exc_type == "ValueError"
        assert "ranks disagree on the model" in r.message and "[1]" in r.message


def _param_left_out_on_rank_1(rank, world):
    model = make()
    params = list(model.parameters())
    zerocore.wrap(model, torch.optim.AdamW(params[:-1] if rank == 1 else params), {"stage": 3})


def test_a_problem_on_one_rank_fails_every_rank():
    results = run_ranks(_param_left_out_on_rank_1, 2, raise_errors=False, timeout=30)
    assert all(isinstance(r, RankError) and r.exc_type == "ValueError" for r in results)
    assert "not in the optimizer" in results[1].message
    assert "rank(s) [1] rejected the model" in results[0].message


def _snapshot(engine):
    state = [(g.buffers.get("master"), *g.optimizer_states().values()) for g in engine.parts.groups if g.trainable]
    return engine.full_state_dict(), [[t.clone() for t in ts if t is not None] for ts in state]


def _poisoned_step(rank, world, stage, dtype, poison):
    """Trains until a step applies (fp16 starts with a scale that overflows
    and halves it until it fits), then multiplies rank 1's loss by `poison`
    for one step, then trains one more step. Returns what each rank saw."""
    model = make()
    engine = zerocore.wrap(model, adamw(model), {"stage": stage, "dtype": dtype, "bucket_bytes": 512})
    out = {"warmup": 0}

    def train_step(step, factor=1.0):
        x, y = lm_batch(step, 0, world)
        loss = lm_loss(engine(local(x, rank, world)), local(y, rank, world))
        engine.backward(loss * factor if rank == 1 else loss)
        applied = engine.step()
        engine.zero_grad()
        return applied

    while not train_step(out["warmup"]):
        out["warmup"] += 1
        assert out["warmup"] < 30, "dynamic loss scaling never found a scale that fits"
    out["scale_before"] = engine.loss_scale
    out["unchanged"] = _snapshot(engine)
    out["step_count"] = engine.step_count
    try:
        out["applied_poisoned"] = train_step(100, poison)
    except zerocore.NonFiniteGradientError as e:
        out["error"] = str(e)
        engine.zero_grad()  # the step given up, as the error says
    out["after"] = _snapshot(engine)
    out["scale_after"] = engine.loss_scale
    out["applied_next"] = train_step(101)
    return out


def _assert_same_snapshot(a, b):
    sd_a, st_a = a
    sd_b, st_b = b
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), k
    for ts_a, ts_b in zip(st_a, st_b):
        for x, y in zip(ts_a, ts_b):
            assert torch.equal(x, y)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_overflow_skips_the_step_on_every_rank(stage):
    results = run_ranks(_poisoned_step, 2, stage, "fp16", math.inf)
    for r in results:
        assert r["warmup"] == results[0]["warmup"]  # every rank skipped the same steps
        assert r["applied_poisoned"] is False and r["applied_next"] is True
        assert r["scale_after"] == r["scale_before"] / 2
        _assert_same_snapshot(r["unchanged"], r["after"])  # params and optimizer state untouched


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_nan_loss_raises_on_every_rank_and_changes_nothing(stage, dtype):
    results = run_ranks(_poisoned_step, 2, stage, dtype, math.nan)
    for r in results:
        assert r["warmup"] == 0
        # Steps counted as engine.step_count counts them; the advice fits a NaN loss from bad data.
        assert f"engine.step_count stays {r['step_count']})" in r["error"] and r["step_count"] == 1, r["error"]
        assert "bad data" in r["error"] and "engine.zero_grad() on every rank" in r["error"], r["error"]
        _assert_same_snapshot(r["unchanged"], r["after"])
        assert r["applied_next"] is True


def _refused_later(rank, world, config):
    """As on a GPU (the checking backend's compute_inline=False), a NaN loss
    on rank 1 at step 2 is refused on the device (offloaded: on the host
    update's stream) and named at step 3's exchange; then a NaN at step 5
    (the last) is named by full_state_dict. Returns each error, the step
    counts, and the params against a twin that trained only the batches
    that applied (1 and 4), on the plain backend."""
    backend = _native.CheckingBackend(seed=rank, compute_inline=False)
    model, twin_model = make(), make()
    engine = zerocore.wrap(model, adamw(model), dict(config, bucket_bytes=512), backend=backend)
    twin = zerocore.wrap(twin_model, adamw(twin_model), dict(config, bucket_bytes=512))
    out = {}

    def train_step(e, step, factor=1.0):
        x, y = lm_batch(step, 0, world)
        loss = lm_loss(e(local(x, rank, world)), local(y, rank, world))
        e.backward(loss * factor if rank == 1 else loss)
        try:
            e.step()
        except zerocore.NonFiniteGradientError as error:
            out[f"error at {step}"] = str(error)
            out[f"count after {step}"] = e.step_count
        e.zero_grad()

    for step, factor in [(1, 1.0), (2, math.nan), (3, 1.0), (4, 1.0), (5, math.nan)]:
        train_step(engine, step, factor)
    try:
        engine.full_state_dict()
    except zerocore.NonFiniteGradientError as error:
        out["error at full_state_dict"] = str(error)
    out["final count"] = engine.step_count
    for step in (1, 4):
        train_step(twin, step)
    out["same"] = all(torch.equal(a, b) for a, b in zip(engine.full_state_dict().values(),
                                                        twin.full_state_dict().values()))
    backend.check()
    return out


@pytest.mark.parametrize("config", [{"stage": 1}, {"stage": 3}, {"stage": 1, "offload_optimizer": "cpu"},
                                    {"stage": 3, "offload_optimizer": "cpu"}], ids=["1", "3", "1-offload", "3-offload"])
def test_a_step_refused_on_the_device_is_named_later_on_every_rank(config):
    for r in run_ranks(_refused_later, 2, config):
        assert set(r) == {"error at 3", "count after 3", "error at full_state_dict", "final count", "same"}, r
        assert "gradients of step 2 held inf/NaN" in r["error at 3"] and "back to 1" in r["error at 3"], r
        assert r["count after 3"] == 1
        assert "gradients of step 3 held inf/NaN" in r["error at full_state_dict"], r  # the 5th batch: step 3
        assert r["final count"] == 2 and r["same"], r


def _fail(grad):
    raise RuntimeError("rank 1 fails")


def _raise_mid_backward_on_rank_1(rank, world, stage):
    model = make()
    engine = zerocore.wrap(model, adamw(model), {"stage": stage, "bucket_bytes": 512})
    if rank == 1:  # the embedding's grad comes last: reductions are in flight by then
        model.embed.weight.register_hook(_fail)
    x, y = lm_batch(0, 0, world)
    engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    engine.step()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_rank_that_raises_mid_backward_fails_the_others_without_a_hang(stage):
    # Rank 1 drains its queue as its engine goes and exits; rank 0's next
    # collective then fails (the peer is gone) instead of waiting forever.
    results = run_ranks(_raise_mid_backward_on_rank_1, 2, stage, raise_errors=False, timeout=30)
    assert all(isinstance(r, RankError) for r in results)
    assert results[1].message == "rank 1 fails"
    assert results[0].exc_type == "RuntimeError"
    if stage == 3:  # the unit schedule's rounds tell rank 0 that its peer failed
        assert results[0].message.startswith("zerocore: 1 other rank(s) failed during this backward"), results[0]
    else:  # stage 2's next control-plane collective finds the peer gone
        assert re.match(r"control-plane all_gather .*: the transport's all_gather raised RuntimeError: "
                        r".*Connection (closed|reset) by peer", results[0].message), results[0]


def _released_param(rank, world):
    model = make(layers=2)
    engine = zerocore.wrap(model, adamw(model), zerocore.Config(stage=3))
    with engine.gathered_params():
        full = model.blocks[0].up.weight.detach().clone()
    weight = model.blocks[0].up.weight  # its unit is released outside forward and backward
    read = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.add_(1.0)
        wrote = None
    except RuntimeError as e:
        wrote = str(e)
    return tuple(weight.shape) == tuple(full.shape), read, wrote


def test_a_released_stage3_param_reads_as_nan_and_refuses_writes():
    """Outside its unit's forward and backward a stage-3 param holds no
    values; reading it must not crash or show another unit's values, and a
    write says why it cannot land (test_module_state.py has the rest)."""
    for same_shape, read, wrote in run_ranks(_released_param, 2):
        assert same_shape and read.isnan().all()
        assert wrote is not None and "add_ on blocks.0.up.weight, a stage-3 param that is released" in wrote
