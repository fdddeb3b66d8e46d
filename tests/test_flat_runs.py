"""zerocore.ops.FlatRuns (a partition's runs stepped in one native call) and
zerocore.ops.sum_of_squares, against torch.optim and float64 torch."""
import math

import pytest
import torch

from zerocore import ops

LENGTHS = [1, 64, 17, 1000, 4099]
GRAD_DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16, torch.float32]
ADAM_GROUPS = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
               dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)]
SGD_GROUPS = [dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True),
              dict(lr=0.05, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)]


def make_runs(gen, with_state1=True, copies=True):
    runs = []
    for i, (n, dtype) in enumerate(zip(LENGTHS, GRAD_DTYPES)):
        runs.append(dict(group=i % 2, param=torch.randn(n, generator=gen), grad=torch.randn(n, generator=gen).to(dtype),
                         state0=torch.zeros(n), state1=torch.zeros(n) if with_state1 else None,
                         copy=torch.empty(n, dtype=torch.bfloat16) if copies and i % 3 else None))
    return runs


def native(runs):
    return ops.FlatRuns([r["group"] for r in runs], [r["param"] for r in runs], [r["grad"] for r in runs],
                        [r["state0"] for r in runs], [r["state1"] for r in runs], [r["copy"] for r in runs])


@pytest.mark.parametrize("adamw", [True, False])
def test_adam_runs_match_torch_and_single_calls(adamw, gen):
    runs = make_runs(gen)
    alone = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in r.items()} for r in runs]
    ref_params = [torch.nn.Parameter(r["param"].clone()) for r in runs]
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref = cls([dict(ADAM_GROUPS[g], params=[p for p, r in zip(ref_params, runs) if r["group"] == g]) for g in (0, 1)])
    flat = native(runs)
    assert len(flat) == len(runs)
    for step in (1, 2, 3):
        flat.adam_(ADAM_GROUPS, step=step, grad_scale=0.5, adamw=adamw)
        for r in alone:
            hp = ADAM_GROUPS[r["group"]]
            ops.adam_(r["param"], r["grad"], r["state0"], r["state1"], step=step, lr=hp["lr"], beta1=hp["betas"][0],
                      beta2=hp["betas"][1], eps=hp["eps"], weight_decay=hp["weight_decay"], adamw=adamw,
                      grad_scale=0.5, param_copy=r["copy"])
        for p, r in zip(ref_params, runs):
            p.grad = r["grad"].float() * 0.5
        ref.step()
    for r, a, p in zip(runs, alone, ref_params):
        for k in ("param", "state0", "state1", "copy"):
            if r[k] is not None:
                assert torch.equal(r[k], a[k]), k  # one call or one per run: the same bits
        torch.testing.assert_close(r["param"], p.detach(), rtol=1e-5, atol=1e-6)
        if r["copy"] is not None:
            assert torch.equal(r["copy"], r["param"].to(torch.bfloat16))


def test_sgd_runs_match_torch(gen):
    runs = make_runs(gen, with_state1=False, copies=False)
    for r in runs:
        if r["group"] == 1:
            r["state0"] = None  # no momentum in that group: no buffer
    ref_params = [torch.nn.Parameter(r["param"].clone()) for r in runs]
    ref = torch.optim.SGD([dict(SGD_GROUPS[g], params=[p for p, r in zip(ref_params, runs) if r["group"] == g])
                           for g in (0, 1)])
    flat = native(runs)
    for step in (1, 2, 3):
        flat.sgd_(SGD_GROUPS, step=step, grad_scale=2.0)
        for p, r in zip(ref_params, runs):
            p.grad = r["grad"].float() * 2.0
        ref.step()
    for r, p in zip(runs, ref_params):
        torch.testing.assert_close(r["param"], p.detach(), rtol=1e-5, atol=1e-6)


def test_sum_of_squares_is_fp64_and_flags_non_finite(gen):
    xs = [torch.randn(n, generator=gen).to(d) * 100 for n, d in zip(LENGTHS, GRAD_DTYPES)]
    expected = sum(float((x.double() ** 2).sum()) for x in xs)
    assert ops.sum_of_squares(xs) == pytest.approx(expected, rel=1e-12)
    assert ops.sum_of_squares(xs) == ops.sum_of_squares(xs)
    runs = make_runs(gen)
    assert native(runs).grad_sum_of_squares() == pytest.approx(sum(float((r["grad"].double() ** 2).sum())
                                                                   for r in runs), rel=1e-12)
    # fp16 grads near their maximum: fp32 accumulation of squares would overflow, fp64 does not.
    big = torch.full((1000,), 60000.0, dtype=torch.float16)
    assert ops.sum_of_squares([big]) == pytest.approx(1000 * 60000.0 ** 2)
    for bad in (math.inf, -math.inf, math.nan):
        xs[2][5] = bad
        assert not math.isfinite(ops.sum_of_squares(xs))


def test_bad_runs_raise_before_writing(gen):
    runs = make_runs(gen)
    before = runs[0]["param"].clone()
    with pytest.raises(ValueError, match="one entry per run"):
        ops.FlatRuns([0], [r["param"] for r in runs], [], [], [], [])
    with pytest.raises(ValueError, match=r"run 1 belongs to param group 1 but options were given for 1 param "
                                         r"group\(s\)"):
        native(runs).adam_(ADAM_GROUPS[:1], step=1, grad_scale=1.0, adamw=True)
    runs[3]["state1"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"adam_ \(run 3\)"):
        native(runs).adam_(ADAM_GROUPS, step=1, grad_scale=1.0, adamw=True)
    with pytest.raises(TypeError, match="sum_of_squares: tensor must be float32, bfloat16 or float16"):
        ops.sum_of_squares([torch.zeros(4, dtype=torch.int32)])
    assert torch.equal(runs[0]["param"], before)
