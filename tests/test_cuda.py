"""zerocore.cuda: the fused CUDA Adam/AdamW kernel.

The first group runs everywhere: the module must import, and answer "not
available", on machines without CUDA, a driver or a GPU. The `gpu` tests
compare the kernel with torch.optim (float64 reference) and, bit for bit,
with the CPU kernel (zerocore.ops.adam_); they are skipped without a device.
"""
import ctypes
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import zerocore.cuda as zc_cuda  # noqa: E402
from reference import assert_close_as_fp32_allows, reference_adam  # noqa: E402
from zerocore import ops  # noqa: E402

GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
COPY_DTYPES = [None, torch.bfloat16, torch.float16]


def _has_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _gpu_ready() -> bool:
    return torch.cuda.is_available() and zc_cuda.is_available()


def gpu(f):
    """Marks a test as needing a CUDA device, and skips it without one."""
    skip = pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA device and zerocore._cuda")
    return pytest.mark.gpu(skip(f))


# --------------------------------------------------------------------------
# Everywhere, GPU or not.


def test_import_is_lazy():
    # A fresh interpreter: importing zerocore.cuda must not load the extension.
    code = (
        "import sys, zerocore, zerocore.cuda\n"
        "assert 'zerocore._cuda' not in sys.modules, 'zerocore._cuda loaded at import'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_queries_answer_without_raising():
    built, available, count = zc_cuda.is_built(), zc_cuda.is_available(), zc_cuda.device_count()
    assert isinstance(built, bool) and isinstance(available, bool) and isinstance(count, int)
    assert available == (built and count > 0)
    if not built:
        assert count == 0 and not available


@pytest.mark.skipif(_has_driver(), reason="a CUDA driver is installed")
def test_no_driver_means_no_device():
    assert zc_cuda.device_count() == 0
    assert zc_cuda.is_available() is False
    if zc_cuda.is_built():
        import zerocore._cuda as ext  # loads without a driver: libcuda is opened lazily

        assert ext.device_count() == 0
        assert ext.unavailable_reason()  # says why, in CUDA's words


@pytest.mark.skipif(_gpu_ready(), reason="a CUDA device is available")
def test_adam_without_device_is_a_clear_runtime_error():
    p = torch.zeros(4)
    with pytest.raises(RuntimeError, match="zerocore") as e:
        zc_cuda.adam_(p, p.clone(), p.clone(), p.clone(), step=1, lr=1e-3)
    print(e.value)


@pytest.mark.skipif(not zc_cuda.is_built(), reason="built without the CUDA kernels")
def test_binding_checks_arguments_before_any_cuda_call():
    # Runs without a GPU: the checks come before the first CUDA call.
    from zerocore import _cuda

    p = torch.zeros(4)
    with pytest.raises(TypeError, match="param"):  # a CPU tensor is on the wrong device
        _cuda.adam_(p, p.clone(), p.clone(), p.clone(), step=1, lr=1e-3)
    with pytest.raises(ValueError, match="1-D"):
        _cuda.adam_(p.view(2, 2), p.clone(), p.clone(), p.clone(), step=1, lr=1e-3)
    with pytest.raises(TypeError, match="adam_: param must be float32, bfloat16 or float16"):
        _cuda.adam_(p.double(), p.clone(), p.clone(), p.clone(), step=1, lr=1e-3)


# --------------------------------------------------------------------------
# On a GPU.


@gpu
@pytest.mark.parametrize("n", [1, 7, 1000003])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("copy_dtype", COPY_DTYPES)
def test_matches_torch_optim(n, grad_dtype, adamw, copy_dtype, gen):
    steps, lr, weight_decay, betas, eps = 12, 1e-2, 0.1, (0.9, 0.999), 1e-8
    grad_scale = 1.0 / 1024 if grad_dtype == torch.float16 else 0.37  # fp16: loss-scaled grads
    p0 = torch.randn(n, generator=gen)
    grads = [(torch.randn(n, generator=gen) / grad_scale).to(grad_dtype) for _ in range(steps)]

    dev = torch.device("cuda")
    p, m, v = p0.to(dev), torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    copy = None if copy_dtype is None else torch.empty(n, dtype=copy_dtype, device=dev)
    for step, g in enumerate(grads, start=1):
        zc_cuda.adam_(p, g.to(dev), m, v, step=step, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                      weight_decay=weight_decay, adamw=adamw, grad_scale=grad_scale, param_copy=copy)
        if copy is not None:
            assert torch.equal(copy, p.to(copy_dtype)), f"param_copy differs at step {step}"

    # On a million elements some are where no fp32 Adam meets float64 (the first GPU run: 1 in 10^6 past a
    # fixed tolerance): each is held to the float64 result, or within twice torch.optim's own fp32 error there.
    hp = dict(adamw=adamw, lr=lr, wd=weight_decay, betas=betas, eps=eps, grad_scale=grad_scale)
    expected, fp32 = reference_adam(p0, grads, **hp), reference_adam(p0, grads, dtype=torch.float32, **hp)
    for name, got, ref, ref32, atol in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), expected, fp32,
                                           (1e-6, 1e-7, 1e-9)):
        assert_close_as_fp32_allows(name, got.cpu(), ref, ref32, rtol=1e-5, atol=atol)


@gpu
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("copy_dtype", COPY_DTYPES)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_bitwise_equal_to_cpu_kernel(grad_dtype, copy_dtype, offset, gen):
    # Both kernels perform the same IEEE operations in the same order. Offset 1
    # puts every GPU array off 16-byte alignment: the scalar path.
    n, steps = 100003, 10
    dev = torch.device("cuda")

    def gpu_view(x):
        buf = torch.empty(n + offset, dtype=x.dtype, device=dev)
        view = buf[offset:]
        view.copy_(x)
        return view

    p_cpu = torch.randn(n, generator=gen)
    m_cpu, v_cpu = torch.zeros(n), torch.zeros(n)
    c_cpu = None if copy_dtype is None else torch.empty(n, dtype=copy_dtype)
    p_gpu, m_gpu, v_gpu = gpu_view(p_cpu), gpu_view(m_cpu), gpu_view(v_cpu)
    c_gpu = None if copy_dtype is None else gpu_view(torch.zeros(n, dtype=copy_dtype))
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen).to(grad_dtype)
        if step == 4:
            g[: n // 2] = 0  # zero gradients: eps alone keeps denom positive
        kw = dict(step=step, lr=3e-3, weight_decay=0.05, adamw=step % 2 == 0, grad_scale=0.75)
        ops.adam_(p_cpu, g, m_cpu, v_cpu, param_copy=c_cpu, **kw)
        zc_cuda.adam_(p_gpu, gpu_view(g), m_gpu, v_gpu, param_copy=c_gpu, **kw)
    assert torch.equal(p_gpu.cpu(), p_cpu)
    assert torch.equal(m_gpu.cpu(), m_cpu)
    assert torch.equal(v_gpu.cpu(), v_cpu)
    if copy_dtype is not None:
        assert torch.equal(c_gpu.cpu(), c_cpu)


@gpu
def test_runs_on_torchs_current_stream(gen):
    # Work queued by torch on a side stream, then the update on the same
    # stream, with no synchronization in between: only correct if adam_ is
    # queued on torch's current stream.
    n = 1 << 22
    p0 = torch.randn(n, generator=gen).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
        torch.cuda._sleep(10_000_000)  # keep the stream busy, so a wrong order shows
        g = torch.ones_like(p0)
        zc_cuda.adam_(p, g, m, v, step=1, lr=0.5)
        result = p.clone()
    torch.cuda.synchronize()
    # Step 1 with g = 1: m/denom = 1/(1 + eps), so p moves by -lr.
    torch.testing.assert_close(result, p0 - 0.5, rtol=0, atol=1e-6)


@gpu
def test_empty_partition_is_a_no_op():
    # Empty slices in the middle of buffers: the call succeeds (no launch of zero blocks, an
    # error in CUDA) and writes nothing, neither at the slices' address nor around it.
    bufs = [torch.full((8,), float(i + 1), device="cuda") for i in range(4)]
    copy = torch.full((8,), 5.0, device="cuda", dtype=torch.bfloat16)
    before = [b.clone() for b in (*bufs, copy)]
    zc_cuda.adam_(*(b[4:4] for b in bufs), param_copy=copy[4:4], step=1, lr=1e-3, weight_decay=0.1)
    torch.cuda.synchronize()
    for b, was in zip((*bufs, copy), before):
        assert torch.equal(b, was), (b, was)


@gpu
def test_requires_grad_param_is_accepted(gen):
    p = torch.nn.Parameter(torch.randn(16, generator=gen).cuda())
    g, m, v = torch.ones_like(p), torch.zeros_like(p), torch.zeros_like(p)
    before = p.detach().clone()
    zc_cuda.adam_(p, g, m, v, step=1, lr=0.1)
    torch.testing.assert_close(p.detach(), before - 0.1, rtol=0, atol=1e-6)


@gpu
def test_bad_arguments():
    dev = "cuda"
    p, g = torch.zeros(8, device=dev), torch.zeros(8, device=dev)
    m, v = torch.zeros(8, device=dev), torch.zeros(8, device=dev)
    kw = dict(step=1, lr=1e-3)
    with pytest.raises(TypeError, match="param"):
        zc_cuda.adam_(p.half(), g, m, v, **kw)  # param must be float32
    with pytest.raises(TypeError, match="exp_avg"):
        zc_cuda.adam_(p, g, m.bfloat16(), v, **kw)
    with pytest.raises(TypeError, match="param_copy"):
        zc_cuda.adam_(p, g, m, v, param_copy=torch.zeros(8, device=dev), **kw)  # float32 copy
    with pytest.raises(TypeError, match="adam_: grad must be float32, bfloat16 or float16"):
        zc_cuda.adam_(p, g.double(), m, v, **kw)  # no float64 gradients
    with pytest.raises(TypeError, match="grad"):
        zc_cuda.adam_(p, g.cpu(), m, v, **kw)  # on the host
    with pytest.raises(ValueError, match="grad"):
        zc_cuda.adam_(p, torch.zeros(7, device=dev), m, v, **kw)  # size mismatch
    with pytest.raises(ValueError, match="param_copy"):
        zc_cuda.adam_(p, g, m, v, param_copy=torch.zeros(9, dtype=torch.bfloat16, device=dev), **kw)
    with pytest.raises(ValueError, match="1-D"):
        zc_cuda.adam_(p.view(2, 4), g, m, v, **kw)
    with pytest.raises(ValueError, match="adam_: param must be contiguous"):
        zc_cuda.adam_(torch.zeros(8, 2, device=dev)[:, 0], g, m, v, **kw)  # not contiguous
    with pytest.raises(ValueError, match="step"):
        zc_cuda.adam_(p, g, m, v, step=0, lr=1e-3)
    with pytest.raises(ValueError, match="beta1"):
        zc_cuda.adam_(p, g, m, v, step=1, lr=1e-3, beta1=1.0)
    assert torch.equal(p, torch.zeros(8, device=dev))  # nothing was written


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_second_device(gen):
    # The kernel runs on the tensors' device, whichever device is current.
    p0 = torch.randn(1000, generator=gen)
    p = p0.to("cuda:1")
    g, m, v = torch.ones_like(p), torch.zeros_like(p), torch.zeros_like(p)
    with torch.cuda.device(0):
        zc_cuda.adam_(p, g, m, v, step=1, lr=0.25)
    assert torch.cuda.current_device() == 0
    torch.testing.assert_close(p.cpu(), p0 - 0.25, rtol=0, atol=1e-6)
    with pytest.raises(TypeError, match="cuda:0"):
        zc_cuda.adam_(p, g.to("cuda:0"), m, v, step=1, lr=0.25)
