"""SIMD CPU optimizers on flat partitions against torch.optim.

Each instruction-set path this CPU can run is checked against a float64
torch.optim reference over many steps on fresh random data, and the paths
against each other bit for bit.
"""
import contextlib

import pytest
import torch

import zerocore
from reference import assert_close_as_fp32_allows, reference_adam
from zerocore import ops

ISAS = zerocore.cpu_features()["supported"]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 7, 64, 65, 1000, 4099]


@contextlib.contextmanager
def isa(name):
    before = zerocore.cpu_features()["isa"]
    zerocore.set_cpu_isa(name)
    try:
        yield
    finally:
        zerocore.set_cpu_isa(before)


@contextlib.contextmanager
def threads(n):
    before = zerocore.num_threads()
    zerocore.set_num_threads(n)
    try:
        yield
    finally:
        zerocore.set_num_threads(before)


def run_adam(p0, grads, *, adamw, lr, wd, betas, eps, grad_scale, copy_dtype):
    """zerocore's adam_ over all grads; returns param, exp_avg, exp_avg_sq, copy."""
    p = p0.clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    copy = torch.empty_like(p, dtype=copy_dtype) if copy_dtype else None
    for step, g in enumerate(grads, 1):
        ops.adam_(p, g, m, v, step=step, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd,
                  adamw=adamw, grad_scale=grad_scale, param_copy=copy)
    return p, m, v, copy


@pytest.mark.parametrize("path", ISAS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("adamw", [True, False])
def test_adam_matches_torch(path, grad_dtype, adamw, gen):
    n = 4099
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(20)]
    hp = dict(adamw=adamw, lr=1e-2, wd=0.1, betas=(0.9, 0.99), eps=1e-8, grad_scale=0.5)
    with isa(path):
        p, m, v, copy = run_adam(p0, grads, copy_dtype=torch.bfloat16, **hp)
    expected = reference_adam(p0, grads, **hp)
    fp32 = reference_adam(p0, grads, dtype=torch.float32, **hp)
    for name, got, ref, ref32, atol in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), expected, fp32,
                                           (1e-6, 1e-7, 1e-9)):
        assert_close_as_fp32_allows(name, got, ref, ref32, rtol=1e-5, atol=atol)
    assert torch.equal(copy, p.to(torch.bfloat16)), "param copy must be the rounded new param"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("copy_dtype", [None, torch.bfloat16, torch.float16])
def test_adam_paths_agree_bitwise(n, copy_dtype, gen):
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(5)]
    hp = dict(adamw=True, lr=3e-3, wd=0.01, betas=(0.9, 0.999), eps=1e-8, grad_scale=0.25)
    results = {}
    for path in ISAS:
        with isa(path):
            results[path] = run_adam(p0, grads, copy_dtype=copy_dtype, **hp)
    first = results[ISAS[0]]
    for path, res in results.items():
        for a, b in zip(first, res):
            assert (a is None and b is None) or torch.equal(a, b), f"{path} differs from {ISAS[0]}"


@pytest.mark.parametrize("nthreads", [1, 2, 3, 5])
def test_adam_thread_count_does_not_change_results(nthreads, gen):
    n = 100_003
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(3)]
    hp = dict(adamw=True, lr=1e-3, wd=0.0, betas=(0.9, 0.999), eps=1e-8, grad_scale=1.0)
    with threads(1):
        expected = run_adam(p0, grads, copy_dtype=torch.float16, **hp)
    with threads(nthreads):
        got = run_adam(p0, grads, copy_dtype=torch.float16, **hp)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def run_sgd(p0, grads, *, copy_dtype=None, grad_scale=1.0, **hp):
    p = p0.clone()
    buf = torch.empty_like(p) if hp.get("momentum", 0) else None
    copy = torch.empty_like(p, dtype=copy_dtype) if copy_dtype else None
    for step, g in enumerate(grads, 1):
        ops.sgd_(p, g, buf, step=step, grad_scale=grad_scale, param_copy=copy, **hp)
    return p, buf, copy


SGD_CONFIGS = [
    dict(lr=0.1),
    dict(lr=0.05, weight_decay=0.01),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=1e-3),
    dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-2),
]


@pytest.mark.parametrize("path", ISAS)
@pytest.mark.parametrize("hp", SGD_CONFIGS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_sgd_matches_torch(path, hp, grad_dtype, gen):
    n = 1000
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(15)]
    with isa(path):
        p, buf, copy = run_sgd(p0, grads, copy_dtype=torch.float16, grad_scale=2.0, **hp)
    ref = torch.nn.Parameter(p0.double())
    opt = torch.optim.SGD([ref], foreach=False, **hp)
    for g in grads:
        ref.grad = g.double() * 2.0
        opt.step()
    # fp32 rounding error grows with the size of the terms summed, not with
    # the final value (which may sit near zero): scale atol to the params.
    scale = float(ref.detach().abs().max())
    torch.testing.assert_close(p.double(), ref.detach(), rtol=1e-5, atol=1e-6 * scale)
    if buf is not None:
        ref_buf = opt.state[ref]["momentum_buffer"]
        torch.testing.assert_close(buf.double(), ref_buf, rtol=1e-5, atol=1e-6 * float(ref_buf.abs().max()))
    assert torch.equal(copy, p.to(torch.float16))


SPECIAL = [0.0, -0.0, 1.0, -2.5, 65504.0, 65519.0, 65520.0, 1e5, -1e5, 6e-5, 6.1e-5, 3e-8, 2.98e-8, 1e-9,
           1e-40, -1e-42, 3.4e38, -3.4e38, float("inf"), float("-inf"), float("nan"), 1.00390625, 1.01171875,
           2.0**-126, 2.0**-133, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11]


@pytest.mark.parametrize("path", ISAS)
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_16bit_copy_rounds_exactly_like_torch(path, copy_dtype, gen):
    # SGD with lr=0 leaves params alone, so the copy is the pure conversion.
    bits = torch.randint(-(2**31), 2**31 - 1, (20000,), generator=gen, dtype=torch.int32)
    values = torch.cat([torch.tensor(SPECIAL), bits.view(torch.float32), torch.randn(5000, generator=gen)])
    values = torch.cat([values, values[: 64 - values.numel() % 64]])  # exercise SIMD and tail
    copy = torch.empty_like(values, dtype=copy_dtype)
    with isa(path):
        ops.sgd_(values.clone(), torch.zeros_like(values), step=1, lr=0.0, param_copy=copy)
    expected = values.to(copy_dtype)
    nan = expected.isnan()
    assert torch.equal(copy.isnan(), nan)
    assert torch.equal(copy[~nan].view(torch.int16), expected[~nan].view(torch.int16))


def test_bad_arguments_raise_clear_errors():
    p, g, m, v = (torch.zeros(8) for _ in range(4))
    kw = dict(step=1, lr=1e-3)
    with pytest.raises(TypeError, match="param must be float32"):
        ops.adam_(p.half(), g, m, v, **kw)
    with pytest.raises(TypeError, match="grad must be float32, bfloat16 or float16"):
        ops.adam_(p, g.double(), m, v, **kw)
    with pytest.raises(TypeError, match="exp_avg_sq must be float32"):
        ops.adam_(p, g, m, v.bfloat16(), **kw)
    with pytest.raises(ValueError, match="exp_avg has 7 elements but param has 8"):
        ops.adam_(p, g, m[:7], v, **kw)
    with pytest.raises(ValueError, match="contiguous"):
        ops.adam_(p, torch.zeros(16)[::2], m, v, **kw)
    with pytest.raises(ValueError, match="1-D"):
        ops.adam_(p.view(2, 4), g, m, v, **kw)
    with pytest.raises(TypeError, match="param_copy must be bfloat16 or float16"):
        ops.adam_(p, g, m, v, param_copy=torch.zeros(8), **kw)
    with pytest.raises(ValueError, match="step must be >= 1"):
        ops.adam_(p, g, m, v, step=0, lr=1e-3)
    with pytest.raises(ValueError, match="beta1"):
        ops.adam_(p, g, m, v, beta1=1.0, **kw)
    with pytest.raises(ValueError, match="lr"):
        ops.adam_(p, g, m, v, step=1, lr=-1.0)
    with pytest.raises(ValueError, match="momentum_buffer is required"):
        ops.sgd_(p, g, step=1, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="nesterov"):
        ops.sgd_(p, g, m, step=1, lr=0.1, momentum=0.9, dampening=0.5, nesterov=True)
    with pytest.raises(ValueError, match="unknown CPU instruction set"):
        zerocore.set_cpu_isa("sse9")
    with pytest.raises(ValueError, match="at least 1"):
        zerocore.set_num_threads(0)
    assert torch.equal(p, torch.zeros(8)), "a rejected call must not touch memory"


def test_cpu_features_names_the_active_path():
    f = zerocore.cpu_features()
    assert f["isa"] in ("scalar", "avx2", "avx512") and f["isa"] in f["supported"]
    assert f["supported"][0] == "scalar" and f["isa"] == f["supported"][-1]
    assert f["threads"] >= 1


def test_optimizer_works_in_a_forked_child():
    # A child inherits the thread pool object but not its threads; it must
    # build its own instead of waiting on threads that do not exist.
    import os
    import time

    p, g, m, v = torch.zeros(1 << 16), torch.ones(1 << 16), torch.zeros(1 << 16), torch.zeros(1 << 16)
    ops.adam_(p, g, m, v, step=1, lr=0.1)  # the parent's pool now has live workers
    pid = os.fork()
    if pid == 0:
        ops.adam_(p, g, m, v, step=2, lr=0.1)
        os._exit(0 if float(p[0]) < -0.1 else 1)
    for _ in range(100):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert status == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    pytest.fail("the optimizer hung in a forked child")
