"""Stage 3's memory follows from the plan, not from the system allocator:
the gather pool and reduce staging are allocated at wrap, so training steps
allocate no native buffer (the runtime counts every host arena it makes)
and add no resident memory once warm, whether glibc keeps freed blocks
resident (its default dynamic mmap threshold) or returns them to the OS
(MALLOC_MMAP_THRESHOLD_ pinned); and wrapping a model built on the meta
device leaves no freed heap behind.

The resident-memory measurements run in a fresh process each (this file as
a script): one rank over gloo, a model whose units are several MB each, so
per-gather allocations, if any came back, would show in megabytes."""
import ctypes
import json
import os
import resource
import subprocess
import sys

import pytest
import torch

import zerocore
from dist_harness import run_ranks
from models import TinyLM, lm_batch, lm_loss, local

STEPS_WARM, STEPS = 25, 25
MB = 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _probe():
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(x)))

    torch.manual_seed(0)
    model = nn.Sequential(*(Block(384) for _ in range(6)))  # 1.2M params (4.7 MB) a block; coalesced, 5 a unit
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = zerocore.wrap(model, opt, {"stage": 3})
    x = torch.randn(4, 16, 384)
    at_wrap = engine.memory_report()
    peaks = []
    for _ in range(STEPS_WARM + STEPS):
        engine.backward(engine(x).square().mean())
        engine.step()
        engine.zero_grad()
        peaks.append(_peak_mb())
    print(json.dumps({"peaks": peaks, "report_at_wrap": at_wrap, "report_after": engine.memory_report()}))
    dist.destroy_process_group()


def _heap_free_kept() -> int:
    """Bytes glibc's heap holds free but resident, over all its arenas (mallinfo2's fordblks)."""

    class MallInfo2(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    fn = ctypes.CDLL(None).mallinfo2
    fn.restype = MallInfo2
    return fn().fordblks


def _probe_wrap():
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with zerocore.init():
        model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8)))  # 4 MiB a weight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = _heap_free_kept()
    zerocore.wrap(model, opt, {"stage": 3})
    print(json.dumps({"kept": _heap_free_kept() - before, "weight_bytes": 1024 * 1024 * 4}))
    dist.destroy_process_group()


def _measure(pinned: bool, probe: str = "steps") -> dict:
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if pinned:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MB)
    out = subprocess.run([sys.executable, __file__, probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs():
    return {pinned: _measure(pinned) for pinned in (False, True)}


def test_no_memory_allocated_after_wrap(runs):
    for pinned in (False, True):
        r = runs[pinned]
        assert r["report_after"] == r["report_at_wrap"]
        # Once warm (torch's own caches, the allocator's arenas) the peak
        # stays put, up to the allocator's drift: memory kept by each step,
        # even a fraction of one unit, would add far more over these steps.
        warm = r["peaks"][STEPS_WARM - 1]
        assert r["peaks"][-1] - warm < 8.0, r["peaks"]


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc's heap statistics (mallinfo2)")
def test_wrap_leaves_no_freed_heap_behind():
    """Initialising a meta-device model at wrap leaves nothing resident beyond
    the engine's buffers under glibc's default settings: each module's
    initial values, made one module at a time on temporary tensors, are not
    kept as a freed heap (glibc would keep them once the first one freed
    raised its mmap threshold)."""
    r = _measure(pinned=False, probe="wrap")
    assert r["kept"] < r["weight_bytes"] // 2, r


def _arenas_per_step(rank, world, stage, offload):
    model = TinyLM(layers=3)
    cfg = {"stage": stage, "bucket_bytes": 4096}
    if offload:
        cfg.update(offload_optimizer="cpu")
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    counts, live = [], []
    for step in range(4):
        before = zerocore.host_arena_allocations()
        x, y = lm_batch(step, 0, world)
        engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
        engine.step()
        engine.zero_grad()
        counts.append(zerocore.host_arena_allocations() - before)
        live.append(zerocore.host_arena_bytes())
    return counts, live


@pytest.mark.parametrize("stage, offload", [(1, False), (2, False), (3, False), (3, True)])
def test_steps_allocate_no_native_buffer(stage, offload):
    """Every buffer the runtime uses (flat params, grads, optimizer states,
    gather pool, reduce staging) is a host arena made at wrap: no step, the
    first included, makes another, and the bytes they hold stay the same."""
    for counts, live in run_ranks(_arenas_per_step, 2, stage, offload):
        assert counts == [0, 0, 0, 0], counts
        assert len(set(live)) == 1, live


if __name__ == "__main__":
    {"steps": _probe, "wrap": _probe_wrap}[sys.argv[1]]()
