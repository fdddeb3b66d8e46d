"""Stage 3's peak memory follows from the plan, not from the system
allocator: the gather pool and reduce staging are allocated at wrap, so
training steps add no resident memory once warm, and zerocore's peak RSS
growth depends on whether glibc keeps freed blocks resident (its default
dynamic mmap threshold) or returns them to the OS (MALLOC_MMAP_THRESHOLD_
pinned) no more than plain torch training the same model does (its
activations and autograd's temporaries go through malloc either way).

Each measurement runs in a fresh process (this file as a script): one rank
over gloo, a model whose units are several MB each, so per-gather
allocations, if any came back, would show in megabytes."""
import json
import os
import resource
import subprocess
import sys

import pytest

STEPS_WARM, STEPS = 25, 25
MB = 2**20


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _probe(mode):
    import socket

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import zerocore

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(x)))

    torch.manual_seed(0)
    model = nn.Sequential(*(Block(384) for _ in range(6)))  # 1.2M params (4.7 MB) a unit
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mode == "zerocore":
        engine = zerocore.wrap(model, opt, {"stage": 3})
        run, backward, step, report = engine, engine.backward, engine.step, engine.memory_report
    else:  # plain torch: the allocator's effect on what any training step allocates
        run, backward, step, report = model, torch.Tensor.backward, opt.step, dict
    x = torch.randn(4, 16, 384)
    base = _rss_mb()
    at_wrap = report()
    peaks = []
    for _ in range(STEPS_WARM + STEPS):
        backward(run(x).square().mean())
        step()
        opt.zero_grad()
        peaks.append(_peak_mb())
    print(json.dumps({"base": base, "peaks": peaks, "report_at_wrap": at_wrap, "report_after": report()}))
    dist.destroy_process_group()


def _measure(mode: str, pinned: bool) -> dict:
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if pinned:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MB)
    out = subprocess.run([sys.executable, __file__, mode], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs():
    return {(mode, pinned): _measure(mode, pinned) for mode in ("zerocore", "torch") for pinned in (False, True)}


def test_no_memory_allocated_after_wrap(runs):
    for pinned in (False, True):
        r = runs["zerocore", pinned]
        assert r["report_after"] == r["report_at_wrap"]
        # Once warm (torch's own caches, the allocator's arenas) the peak
        # stays put, up to the allocator's drift: memory kept by each step,
        # even a fraction of one unit, would add far more over these steps.
        warm = r["peaks"][STEPS_WARM - 1]
        assert r["peaks"][-1] - warm < 8.0, r["peaks"]


def test_peak_does_not_depend_on_the_allocator(runs):
    def allocator_effect(mode):
        growth = {pinned: runs[mode, pinned]["peaks"][-1] - runs[mode, pinned]["base"] for pinned in (False, True)}
        return growth[False] - growth[True]

    # Gathering six 4.7 MB units a step through malloc (or through gloo's
    # tensor collectives, which allocate full-size temporaries) would keep
    # up to a step's gathers, 28 MB, resident under the default allocator;
    # the bound is half of that. Each effect drifts from run to run
    # (measured: zerocore 7-10 MB, plain torch 0.3-11 MB, one run's pair
    # up to 9.6 MB apart); zerocore's may be the smaller by any amount.
    step_gathers = 6 * 4.7
    assert allocator_effect("zerocore") - allocator_effect("torch") <= step_gathers / 2, \
        (allocator_effect("zerocore"), allocator_effect("torch"))


if __name__ == "__main__":
    _probe(sys.argv[1])
