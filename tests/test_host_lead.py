"""What a stage 2-3 forward and backward leave the device to do, by the
checking backend's vector clocks (exact, no timing), on a slow device (a
checking backend whose device-plane streams delay each piece of work by
milliseconds), at world sizes 1 and 2 (issue 31):

- The host runs ahead of the device. The training thread enqueues the
  whole forward and backward (at stage 3 every unit's gathers, at stages
  2-3 every bucket's reductions) before it knows that any of that device
  work is done (CheckingBackend.device_work): on a GPU nothing in them
  waits for the GPU, so the host gets to the step while the device may
  still be on the first unit. (Stages 0-1 issue their reductions at the
  step: their forward and backward give the device nothing to do.)
- Gathers never queue behind reductions: the reductions run on a queue of
  their own (its stream and process group), and the gathers' stream is
  ordered after none of the reductions a backward issues
  (CheckingBackend.ordered_after).
- Steps after the first allocate no device memory (pools are sized up
  front or grow once; on CUDA an allocation synchronises).

A change that makes the host wait for a gather or a reduction, queues a
gather behind a reduction, or grows a pool mid-training shows here."""
import pytest
import torch

import zerocore
from dist_harness import run_ranks
from models import TinyLM, lm_batch, lm_loss, local, make
from zerocore import _native

STEPS = 3


def _per_step(rank, world, stage):
    """Each step's: device operations its forward and backward enqueued, of
    them those the host is ordered after, reductions they issued, of them
    those the gathers' stream is ordered after, and the device allocations
    of the whole step."""
    backend = _native.CheckingBackend(seed=100 + rank, min_delay_us=1000, max_delay_us=3000)
    model = make(TinyLM)
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           zerocore.Config(stage=stage, bucket_bytes=2048), backend=backend)
    gathers, reductions = engine.parts.comm.queue.stream, engine.parts.reduce_comm.queue.stream
    out = []
    for step in range(STEPS):
        x, y = (local(t, rank, world) for t in lm_batch(step, 0, world))
        work, reduced, allocations = (backend.device_work(), backend.ordered_after(gathers, reductions),
                                      backend.device_allocations())
        engine.backward(lm_loss(engine(x), y))
        work_after, reduced_after = backend.device_work(), backend.ordered_after(gathers, reductions)
        engine.step()
        engine.zero_grad()
        out.append(dict(enqueued=work_after[0] - work[0], host_saw=work_after[1] - work[1],
                        reductions=reduced_after[0] - reduced[0], gathers_after=reduced_after[1] - reduced[1],
                        allocations=backend.device_allocations() - allocations))
    engine.close()
    backend.check()
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [2, 3])
def test_forward_and_backward_leave_the_device_its_work(world, stage):
    for rank, per_step in enumerate(run_ranks(_per_step, world, stage, timeout=120)):
        for step, s in enumerate(per_step):
            where = f"rank {rank}, step {step}: {s}"
            assert s["host_saw"] == 0, f"{where}: the host waited for device work"
            # Each bucket's reduction and accumulation, each unit's gather: many.
            assert s["enqueued"] >= 8 and s["reductions"] >= 4, where
            assert s["gathers_after"] == 0, f"{where}: gathers ordered after reductions"
            if step > 0:
                assert s["allocations"] == 0, f"{where}: device allocations mid-training"
