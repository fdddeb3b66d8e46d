"""Opaque native tensors cross to and from torch through DLPack, zero-copy."""
import gc

import pytest
import torch

import zerocore

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.mark.parametrize("name", DTYPES)
def test_native_to_torch_shares_memory(name):
    z = zerocore.empty([3, 5], name)
    t = zerocore.to_torch(z)
    assert t.dtype == DTYPES[name] and t.shape == (3, 5) and t.device.type == "cpu"
    assert t.data_ptr() == z.data_ptr
    t.fill_(1.5)
    again = torch.from_dlpack(z)  # a second view sees the write
    assert torch.equal(again, torch.full((3, 5), 1.5, dtype=DTYPES[name]))
    assert z.shape == (3, 5) and z.numel == 15 and z.dtype == name and z.device == "cpu"


@pytest.mark.parametrize("dtype", DTYPES.values())
def test_torch_to_native_shares_memory(dtype, gen):
    t = torch.randn(7, generator=gen).to(dtype)
    z = zerocore.from_torch(t)
    assert z.data_ptr == t.data_ptr() and z.numel == 7
    back = torch.from_dlpack(z)
    back.mul_(2)  # a write through the round trip is visible in the original
    assert back.data_ptr() == t.data_ptr()
    assert torch.equal(t, back)


def test_native_memory_freed_with_last_holder():
    gc.collect()  # an earlier test's engine (a module-engine cycle) must not be freed mid-measurement
    base = zerocore.host_arena_bytes()
    z = zerocore.empty([1000], "float32")
    assert zerocore.host_arena_bytes() == base + 4000
    t = zerocore.to_torch(z)
    del z
    gc.collect()
    assert zerocore.host_arena_bytes() == base + 4000, "torch still holds the memory"
    t.fill_(3.0)  # and may still use it
    del t
    gc.collect()
    assert zerocore.host_arena_bytes() == base


def test_wrapped_torch_tensor_outlives_torch_reference():
    t = torch.arange(10, dtype=torch.float32)
    z = zerocore.from_torch(t)
    del t
    gc.collect()
    assert torch.equal(torch.from_dlpack(z), torch.arange(10, dtype=torch.float32))


def test_large_arena_asks_for_huge_pages():
    z = zerocore.empty([1 << 20], "float32")  # 4 MiB: above the huge-page threshold
    assert z.data_ptr % (2 << 20) == 0
    t = zerocore.to_torch(z)
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * (1 << 20)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_zeros_hold_no_memory_until_written():
    """Optimizer moments and grads are zeros until the first step: a large
    arena of zeros is reserved, not resident, until written."""
    before = _rss_mb()
    t = zerocore.to_torch(zerocore.zeros([64 << 20], "float32"))  # 256 MiB
    assert _rss_mb() - before < 16
    t[: 16 << 20].fill_(1.0)  # 64 MiB written: now resident (the measurement can see it)
    assert _rss_mb() - before > 48
    assert int(t[16 << 20:].count_nonzero()) == 0 and float(t[: 16 << 20].sum()) == 16 << 20


@pytest.mark.parametrize("name", DTYPES)
def test_small_zeros_are_zeros_in_reused_memory(name):
    dirty = zerocore.to_torch(zerocore.empty([1000], name)).fill_(7.0)
    del dirty  # its block goes back to malloc, which may hand it out again
    z = zerocore.to_torch(zerocore.zeros([1000], name))
    assert int(z.count_nonzero()) == 0


def test_bad_inputs_are_rejected_clearly():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        zerocore.from_torch(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        zerocore.from_torch(torch.zeros(4, 4)[:, 1])
    with pytest.raises(TypeError, match="DLPack"):
        zerocore.from_torch([1.0, 2.0])
    with pytest.raises(ValueError, match="unknown dtype"):
        zerocore.empty([2], "float64")
