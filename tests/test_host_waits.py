"""Blocking host waits per step, counted by the checking backend (run under
ZEROCORE_BACKEND=checking: tests/run.sh's checking pass; skipped
otherwise), and of those the ones that wait for device work.

Host waits: the target (issue 20) is one host wait a step at stages 1-2,
and at stage 3 for a dense model where no rank needs a unit it lacks, plus
the ranks' meeting on their micro-batch counts (issue 36, below). A
wait whose reader is the compute stream (the update reading reduced grads,
a forward reading gathered params) is a stream wait, not a host wait: on
CUDA the host goes on. The counts below (2 ranks, this model, default
buckets) are asserted exactly so a change shows either way. Only waits
through the queues' backend are counted (the comm queues' events); a
torch.distributed call the engine makes directly is not.

Device waits (take_device_waits: a host wait for work of a compute, data
or copy stream, directly or through a control-plane stream that waited for
it): on CUDA each stalls the host until the GPU catches up, so the host
cannot run ahead of it. Stage 3's rounds are control-plane collectives of
host flags (none at world size 1, where there is nothing to agree on): a
forward and a backward wait for no device work at any world size, stage,
dtype, model or offload. The step's exchange waits for the device (its decision reads the
sum of squares a kernel wrote) only where the host must read a number:
fp16's overflow decision (dynamic loss scaling), clipping's norm.
Elsewhere (fp32 and bf16 without clipping) the step decides on the device
(DeviceVerdict), the offloaded update's too: no device wait in step()
either."""
import pytest
import torch

import zerocore
from dist_harness import run_ranks
from models import LateGrads, TinyLM, lm_batch, lm_loss, local, make
from zerocore import _native
from zerocore.examples.moe import MoEConfig, MoEGPT

CHECKER = _native.process_backend()  # every engine's here, since none is given a backend
pytestmark = pytest.mark.skipif(not isinstance(CHECKER, _native.CheckingBackend),
                                reason="counts host waits under ZEROCORE_BACKEND=checking only")

STEPS = 3
# (forward, backward, engine.step()) host waits of a step after the first.
# Every stage: the step's control exchange, the one the host must read (the
# norm, flags, the order fingerprint, stage 2's late grads: before they rode
# on it, stage 2's backward made one more, (0, 1, 1); stage 3's end-of-step
# round: before it rode on it, stage 3's step made 2). At stage 3 the unit
# hooks settle rounds (control-plane reads of the ranks' flags), 6 in
# backward before the late grads' fold.
# The step's own waits do not grow with the number of buckets (checked with
# small ones). One more at the step at every stage, in stage 2's backward
# and in stage 3's forward: the ranks' meeting on their micro-batch counts
# (engine/meeting.py, issue 36: uneven counts raise at once instead of waiting
# out the timeout), a gather of host numbers that waits for no device work.
MEASURED = {0: (0, 0, 2), 1: (0, 0, 2), 2: (0, 1, 2), 3: (4, 5, 2)}
# A step whose last backward left late grads (models.LateGrads at stage 2)
# agrees on them in its exchange and reduces them after it: decided on the
# device, nothing more (the verdict counts the reduced partitions); where
# the host reads the norm, a second exchange of the sums after reducing.
MEASURED_LATE = (0, 1, 2)


def _dense_loss(engine, x, y):
    return lm_loss(engine(x), y)


def _per_step(engine, rank, world, take, loss_of=_dense_loss):
    """take()'s count (host or device waits) in each step's forward,
    backward and engine.step(), for STEPS steps of this rank's batch."""
    counts = []
    for step in range(STEPS):
        x, y = (local(t, rank, world) for t in lm_batch(step, 0, world))
        take()
        loss = loss_of(engine, x, y)
        forward = take()
        engine.backward(loss)
        backward = take()
        engine.step()
        counts.append((forward, backward, take()))
        engine.zero_grad()
    engine.close()
    return counts


def _count(rank, world, stage, bucket_bytes, model_class=TinyLM):
    model = make(model_class)
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           zerocore.Config(stage=stage, **bucket_bytes))
    return _per_step(engine, rank, world, CHECKER.take_host_waits)


MOE = dict(vocab=40, n_layer=2, n_head=2, d_model=16, seq_len=12, n_experts=3)


def _moe_loss(engine, x, y):
    return engine(x % MOE["vocab"], y % MOE["vocab"])["loss"]


# The offloaded update (Config fields), by the cases' names.
OFFLOAD = {None: {}, "cpu": dict(offload_optimizer="cpu"),
           "delayed": dict(offload_optimizer="cpu", delayed_update=True, delayed_update_warmup=0)}


def _device_waits(rank, world, cases):
    """(forward, backward, step) device waits of each step after the first,
    for each (stage, dtype, model, offload) case, trained in turn on these
    ranks."""
    out = {}
    for case in cases:
        stage, dtype, model_name, offload = case
        model = make(TinyLM) if model_name == "dense" else MoEGPT(MoEConfig(**MOE), seed=0)
        engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               zerocore.Config(stage=stage, dtype=dtype, **OFFLOAD[offload]))
        loss_of = _moe_loss if model_name == "moe" else _dense_loss
        out[case] = _per_step(engine, rank, world, CHECKER.take_device_waits, loss_of)[1:]
    return out


# forward, backward, step (see the module's doc): fp16's dynamic loss
# scaling reads the norm (its overflow decision), one device wait a step;
# fp32 and bf16 decide on the device (DeviceVerdict), none.
DEVICE_WAITS = {"fp32": (0, 0, 0), "bf16": (0, 0, 0), "fp16": (0, 0, 1)}


# Offload's update (stages 1-3) is decided the same way, its verdict on
# the host update's stream: the training thread waits for none of it.
OFFLOADED = [(s, d, "dense", o) for s in (1, 2, 3) for d in ("fp32", "bf16", "fp16") for o in ("cpu", "delayed")]


@pytest.mark.parametrize("world, cases", [
    (1, [(s, d, m, None) for s in (0, 1, 2, 3) for d in ("fp32", "bf16", "fp16") for m in ("dense", "moe")]
     + OFFLOADED),
    (2, [(s, d, m, None) for s in (0, 1, 2, 3) for d in ("fp32", "bf16", "fp16") for m in ("dense", "moe")]
     + OFFLOADED),
    (4, [(s, "bf16", m, None) for s in (0, 1, 2, 3) for m in ("dense", "moe")]
     + [(s, "bf16", "dense", o) for s in (1, 2, 3) for o in ("cpu", "delayed")]),
], ids=["world1", "world2", "world4"])
def test_forward_and_backward_wait_for_no_device_work(world, cases):
    for rank, counts in enumerate(run_ranks(_device_waits, world, cases, timeout=300)):
        for case, per_step in counts.items():
            assert per_step == [DEVICE_WAITS[case[1]]] * (STEPS - 1), \
                f"rank {rank}, (stage, dtype, model, offload) {case}: {per_step}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_host_waits_per_step(stage):
    for counts in run_ranks(_count, 2, stage, {}, timeout=120):
        assert counts[1:] == [MEASURED[stage]] * (STEPS - 1), f"stage {stage}: host waits per step {counts}"


def test_late_grads_cost_no_second_exchange():
    for counts in run_ranks(_count, 2, 2, dict(bucket_bytes=512), LateGrads, timeout=120):
        assert counts[1:] == [MEASURED_LATE] * (STEPS - 1), f"host waits per step {counts}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_host_waits_do_not_grow_with_buckets(stage):
    for counts in run_ranks(_count, 2, stage, dict(bucket_bytes=256), timeout=120):
        assert [c[2] for c in counts] == [MEASURED[stage][2]] * STEPS, f"stage {stage}: host waits per step {counts}"
