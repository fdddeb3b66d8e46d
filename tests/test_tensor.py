"""Opaque native tensors cross to and from torch through DLPack, zero-copy."""
import ctypes
import gc
import re

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
    base, made = zerocore.host_arena_bytes(), zerocore.host_arena_allocations()
    z = zerocore.empty([1000], "float32")
    assert zerocore.host_arena_bytes() == base + 4000
    assert zerocore.host_arena_allocations() == made + 1
    t = zerocore.to_torch(z)
    del z
    gc.collect()
    assert zerocore.host_arena_bytes() == base + 4000, "torch still holds the memory"
    t.fill_(3.0)  # and may still use it
    del t
    gc.collect()
    assert zerocore.host_arena_bytes() == base
    assert zerocore.host_arena_allocations() == made + 1  # a count of arenas made, not of live ones


def test_wrapped_torch_tensor_outlives_torch_reference():
    t = torch.arange(10, dtype=torch.float32)
    z = zerocore.from_torch(t)
    del t
    gc.collect()
    assert torch.equal(torch.from_dlpack(z), torch.arange(10, dtype=torch.float32))


def _thp_mode():
    """The kernel's transparent huge page mode (always, madvise, never), or
    None without THP."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)
    except OSError:
        return None


def _mapping(address) -> dict:
    """/proc/self/smaps' fields for the mapping that holds `address`."""
    with open("/proc/self/smaps") as f:
        found = None
        for line in f:
            start = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if start:
                if found is not None:
                    return found
                if int(start.group(1), 16) <= address < int(start.group(2), 16):
                    found = {}
            elif found is not None:
                key, value = line.split(":", 1)
                found[key] = value.strip()
    assert found is not None, f"no mapping holds {address:#x}"
    return found


def _anon_huge_kb(address) -> int:
    return int(_mapping(address)["AnonHugePages"].split()[0])


def test_large_arena_asks_for_and_gets_huge_pages():
    z = zerocore.empty([1 << 20], "float32")  # 4 MiB: above the huge-page threshold
    assert z.data_ptr % (2 << 20) == 0  # where a huge page can start
    t = zerocore.to_torch(z)
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * (1 << 20)
    mode = _thp_mode()
    if mode is None:
        pytest.skip("the kernel has no transparent huge pages")
    # The advice (madvise(MADV_HUGEPAGE)) is on the arena's mapping: "hg" in its flags.
    assert "hg" in _mapping(z.data_ptr)["VmFlags"].split(), _mapping(z.data_ptr)
    if mode == "never":
        pytest.skip("transparent huge pages are off (mode never): the advice is all there is to check")
    if _anon_huge_kb(z.data_ptr) == 0:
        # None given: the kernel may have had no free 2 MiB page. Ask it the same for a region of our own.
        import mmap

        control = mmap.mmap(-1, 6 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        control.madvise(mmap.MADV_HUGEPAGE)
        control.write(b"x" * (6 << 20))
        address = ctypes.addressof(ctypes.c_char.from_buffer(control))
        if _anon_huge_kb(address) == 0:
            pytest.skip("the kernel gave no huge page to a madvise'd region of the test's own either")
        pytest.fail(f"written, the arena has no huge page; a madvise'd region of the test's own has "
                    f"{_anon_huge_kb(address)} kB: {_mapping(z.data_ptr)}")


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
    """A small arena comes from malloc, whose freed blocks come back dirty:
    zeros() must clear them. Blocks are dirtied and freed side by side (so
    malloc can merge them: a freed block alone is too small for the next
    aligned request), then arenas of zeros are made, and kept, until one
    lies in dirtied memory; each must read as zeros."""
    dirty = [zerocore.empty([1000], name) for _ in range(16)]
    for d in dirty:
        torch.from_dlpack(d).fill_(7.0)
    nbytes = 1000 * DTYPES[name].itemsize
    ranges = [(d.data_ptr, d.data_ptr + nbytes) for d in dirty]
    del d, dirty  # the blocks go back to malloc
    kept = []
    for _ in range(64):
        z = zerocore.zeros([1000], name)
        kept.append(z)
        assert int(torch.from_dlpack(z).count_nonzero()) == 0
        if any(z.data_ptr < end and start < z.data_ptr + nbytes for start, end in ranges):
            return
    pytest.skip("malloc handed out none of the freed blocks' memory again in 64 allocations")


def test_bad_inputs_are_rejected_clearly():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        zerocore.from_torch(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        zerocore.from_torch(torch.zeros(4, 4)[:, 1])
    with pytest.raises(TypeError, match="DLPack"):
        zerocore.from_torch([1.0, 2.0])
    with pytest.raises(ValueError, match="unknown dtype"):
        zerocore.empty([2], "float64")
