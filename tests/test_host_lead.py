"""The host runs ahead of the device (issue 31), and a step allocates no
device memory once the first is done (pools are sized up front or grow
once). On a slow device (a
checking backend whose device-plane streams delay each piece of work by
milliseconds), the training thread enqueues a whole forward and backward
of a dense model (at stage 3 every unit's gathers, at stages 2-3 every
bucket's reductions; stages 0-1 issue theirs at the step, and their
forward and backward no device work) before it knows that any of that
device work is done.
By the checker's vector clocks (CheckingBackend.device_work), the host is
ordered after none of the device work a forward and backward enqueue: on
a GPU, nothing in them waits for the GPU, so the host gets to the step
while the device may still be on the first unit. The clocks make it exact
(no timing): a change that makes the host wait for a gather or a
reduction shows here at once."""
import pytest
import torch

import zerocore
from dist_harness import run_ranks
from models import TinyLM, lm_batch, lm_loss, local, make
from zerocore import _native

STEPS = 3


def _lead(rank, world, stage):
    """(device operations enqueued, of them seen by the host) during each
    step's forward and backward, and the device allocations of the whole
    step."""
    backend = _native.CheckingBackend(seed=100 + rank, min_delay_us=1000, max_delay_us=3000)
    model = make(TinyLM)
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           zerocore.Config(stage=stage, bucket_bytes=2048), backend=backend)
    out = []
    for step in range(STEPS):
        x, y = (local(t, rank, world) for t in lm_batch(step, 0, world))
        enqueued, seen = backend.device_work()
        allocations = backend.device_allocations()
        engine.backward(lm_loss(engine(x), y))
        enqueued_after, seen_after = backend.device_work()
        engine.step()
        engine.zero_grad()
        out.append((enqueued_after - enqueued, seen_after - seen, backend.device_allocations() - allocations))
    engine.close()
    backend.check()
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [2, 3])
def test_forward_and_backward_run_ahead_of_a_slow_device(world, stage):
    for rank, per_step in enumerate(run_ranks(_lead, world, stage, timeout=120)):
        for step, (enqueued, seen, allocations) in enumerate(per_step):
            assert seen == 0, f"rank {rank}, step {step}: the host waited for {seen} of {enqueued} device operations"
            # Each bucket's reduction and accumulation, each unit's gather: many.
            assert enqueued >= 8, f"rank {rank}, step {step}: only {enqueued} device operations"
            if step > 0:
                assert allocations == 0, f"rank {rank}, step {step}: {allocations} device allocations mid-training"
