"""zerocore._native.CudaBackend: the CUDA backend of the seam, from Python.

The first group runs wherever zerocore was built with CUDA, GPU or not:
making a backend touches no CUDA, arguments are checked before any CUDA
call, and a failed CUDA call names itself. The `gpu` tests drive the backend
with torch's current stream as its compute stream and compare with torch on
fresh random inputs; they are skipped without a device.
"""
import pytest

torch = pytest.importorskip("torch")

import zerocore.cuda as zc_cuda  # noqa: E402
from zerocore import _native  # noqa: E402

built = pytest.mark.skipif(not zc_cuda.is_built(), reason="built without CUDA")


def gpu(f):
    """Marks a test as needing a CUDA device, and skips it without one."""
    ready = zc_cuda.is_built() and torch.cuda.is_available() and zc_cuda.is_available()
    return pytest.mark.gpu(pytest.mark.skipif(not ready, reason="needs a CUDA device and a CUDA build")(f))


def test_built_with_cuda_exactly_when_the_kernels_are():
    assert hasattr(_native, "CudaBackend") == zc_cuda.is_built()


@built
def test_arguments_are_checked_before_any_cuda_call():
    backend = _native.CudaBackend(0)  # touches no CUDA
    stream = backend.compute_stream()
    with pytest.raises(ValueError, match=r"copy: 4 float32 elements into 4 bfloat16 .* does not convert"):
        backend.copy(stream, torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4))
    other = _native.CheckingBackend()
    with pytest.raises(ValueError, match="belongs to another backend"):
        backend.fill(other.compute_stream(), torch.zeros(4), 1.0)
    with pytest.raises(ValueError, match="unknown memory kind"):
        backend.allocate("vram", 16, "x")


@built
@pytest.mark.skipif(zc_cuda.is_available(), reason="a CUDA device is available")
def test_without_a_device_the_failed_call_is_named():
    backend = _native.CudaBackend(0)
    with pytest.raises(RuntimeError, match=r"zerocore: cuda\w+ failed: cuda\w+"):
        backend.allocate("device", 64, "x")


def _as_torch(buffer, dtype, n):
    return torch.from_dlpack(buffer.view(0, dtype, [n]))


@gpu
@pytest.mark.parametrize("src_kind", ["host_pageable", "host_pinned", "device"])
@pytest.mark.parametrize("dst_kind", ["host_pageable", "host_pinned", "device"])
def test_copy_between_kinds_on_its_own_stream(src_kind, dst_kind, gen):
    backend = _native.CudaBackend(0, torch.cuda.current_stream().cuda_stream)
    copies = backend.create_stream("copy")
    n = 100003
    expected = torch.randn(n, generator=gen).to(torch.bfloat16)
    src = _as_torch(backend.allocate(src_kind, 2 * n, "src"), "bfloat16", n)
    dst = _as_torch(backend.allocate(dst_kind, 2 * n, "dst"), "bfloat16", n)
    assert src.is_cuda == (src_kind == "device") and dst.is_cuda == (dst_kind == "device")
    src.copy_(expected)  # by torch, on its current stream: the backend's compute stream
    backend.wait(copies, backend.record(backend.compute_stream()))
    backend.copy(copies, dst, src)
    backend.host_wait(backend.record(copies))
    assert torch.equal(dst.cpu(), expected)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fill_rounds_as_torch(dtype, gen):
    backend = _native.CudaBackend(0, torch.cuda.current_stream().cuda_stream)
    value = float(torch.randn(1, generator=gen))
    t = torch.empty(1001, dtype=dtype, device="cuda")
    backend.fill(backend.compute_stream(), t, value)
    assert torch.equal(t.cpu(), torch.full((1001,), value, dtype=torch.float32).to(dtype))


@gpu
def test_events_order_torch_work_across_streams(gen):
    # torch writes on a side stream made current; the backend's comm stream
    # waits for it, copies, and torch's stream waits back before reading.
    side = torch.cuda.Stream()
    x = torch.randn(1 << 22, generator=gen)
    with torch.cuda.stream(side):
        backend = _native.CudaBackend(0, torch.cuda.current_stream().cuda_stream)
        comm = backend.create_stream("comm")
        src = torch.empty(x.numel(), device="cuda")
        dst = torch.empty_like(src)
        for round in range(3):
            src.copy_(x + round)
            backend.wait(comm, backend.record(backend.compute_stream()))
            backend.copy(comm, dst, src)
            backend.wait(backend.compute_stream(), backend.record(comm))
            assert torch.equal(dst.cpu(), x + round)
    done = backend.record(comm)
    backend.host_wait(done)
    assert backend.query(done)
    assert backend.stream_handle(backend.compute_stream()) == side.cuda_stream
