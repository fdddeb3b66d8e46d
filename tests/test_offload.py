"""ZeRO-Offload (Config(offload_optimizer="cpu"), offload_params,
delayed_update) on CPU ranks: the host pipeline gives the bits the
on-device step gives; the delayed update matches a reference that applies
the same one-step staleness; a skipped fp16 step with an update pending
lands it for the next forward; memory and copy volumes match the formulas;
a host without the memory, or an allocation that fails on one rank, fails
every rank at wrap.
"""
import math

import pytest
import torch

import zerocore
import zerocore.flat_group
import zerocore.state.offload
from dist_harness import RankError, run_ranks
from models import lm_batch, lm_loss, local, make

HP = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.99))
TINY = 256  # bytes a bucket: params straddle buckets and ranks


def _train(engine, rank, world, steps, accum, scheduler=None, first=0):
    losses = []
    for step in range(first, first + steps):
        total = 0.0
        for micro in range(accum):
            x, y = lm_batch(step, micro, world)
            loss = lm_loss(engine(local(x, rank, world)), local(y, rank, world))
            engine.backward(loss)
            total += loss.item()
        engine.step()
        engine.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(total)
    return losses


def _wrap(config, optimizer=torch.optim.AdamW, **hp):
    model = make(layers=3)
    opt = optimizer(model.parameters(), **(hp or HP))
    engine = zerocore.wrap(model, opt, zerocore.Config(bucket_bytes=TINY, **config))
    return engine, torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=2, gamma=0.5)


def _offload_and_not(rank, world, config, optimizer, hp):
    out = []
    for offload in ({}, {"offload_optimizer": "cpu", **({"offload_params": "cpu"} if config["stage"] == 3 else {})}):
        engine, scheduler = _wrap({**config, **offload}, optimizer, **hp)
        losses = _train(engine, rank, world, steps=4, accum=2, scheduler=scheduler)
        out.append((losses, engine.full_state_dict()))
    return out


CASES = [(dict(stage=s, dtype=d, max_grad_norm=0.05), torch.optim.AdamW, {})
         for s in (1, 2, 3) for d in ("fp32", "bf16", "fp16")]
CASES += [(dict(stage=2, dtype="bf16"), torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
          (dict(stage=3, dtype="fp32", persist_threshold=40), torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01))]


@pytest.mark.parametrize("config,optimizer,hp", CASES, ids=lambda c: str(c) if isinstance(c, dict) else None)
def test_host_step_gives_the_bits_of_the_device_step(config, optimizer, hp):
    """Same kernels on the same inputs: the pipeline (grads down, bucket by
    bucket updates on the host's threads, params up behind them) changes
    nothing, with clipping, accumulation, an lr schedule, fp16 loss scaling."""
    for rank, ((loss0, state0), (loss1, state1)) in enumerate(run_ranks(_offload_and_not, 2, config, optimizer, hp)):
        assert loss0 == loss1, f"rank {rank}: losses differ"
        for k in state0:
            assert torch.equal(state0[k], state1[k]), f"rank {rank}: {k} differs with offload"


# The delayed update -------------------------------------------------------
WARMUP, STEPS = 2, 6


def _delayed(rank, world, stage, offload_params=None):
    engine, scheduler = _wrap(dict(stage=stage, offload_optimizer="cpu", offload_params=offload_params,
                                   delayed_update=True, delayed_update_warmup=WARMUP, max_grad_norm=0.5))
    losses = _train(engine, rank, world, STEPS, accum=1, scheduler=scheduler)
    return losses, engine.full_state_dict()


def _stale_reference(world, delayed=True):
    """Single-process float64 training where the model computing the grads
    of a delayed step holds the params from before the previous update."""
    master = make(layers=3).double()
    trained = make(layers=3).double()  # the params forward and backward use
    opt = torch.optim.AdamW(master.parameters(), **HP)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = []
    for step in range(STEPS):
        x, y = lm_batch(step, 0, world)
        loss = lm_loss(trained(x), y)
        loss.backward()
        losses.append(loss.item())
        for p, q in zip(master.parameters(), trained.parameters()):
            p.grad, q.grad = q.grad, None
        torch.nn.utils.clip_grad_norm_(master.parameters(), 0.5)
        before = [p.detach().clone() for p in master.parameters()]
        opt.step()
        scheduler.step()
        now = before if delayed and step + 1 > WARMUP else [p.detach() for p in master.parameters()]
        with torch.no_grad():
            for q, v in zip(trained.parameters(), now):
                q.copy_(v)
    return losses, master.state_dict()


@pytest.mark.parametrize("stage,offload_params", [(1, None), (2, None), (3, None), (3, "cpu")])
def test_delayed_update_matches_a_reference_one_step_stale(stage, offload_params):
    world = 2
    _, ref = _stale_reference(world)
    _, undelayed = _stale_reference(world, delayed=False)
    for rank, (_, state) in enumerate(run_ranks(_delayed, world, stage, offload_params)):
        for k, v in ref.items():
            torch.testing.assert_close(state[k].double(), v, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank} {k}: {m}")
        # The staleness is real: the same bound rejects training without it.
        assert not all(torch.allclose(state[k].double(), undelayed[k], rtol=1e-4, atol=1e-5) for k in ref)


def _grad_buffers_per_step(rank, world, stage):
    engine, _ = _wrap(dict(stage=stage, offload_optimizer="cpu", delayed_update=True, delayed_update_warmup=1))
    out = []
    for step in range(4):
        _train(engine, rank, world, steps=1, accum=1, first=step)
        out.append([(g.grad_part.data_ptr(), g.host_grad.data_ptr()) for g in engine.groups if g.trainable])
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_delayed_update_swaps_the_two_host_grad_buffers_instead_of_copying(stage):
    """Stages 2-3: the buffer the last backward reduced into becomes the one
    the update reads, and the other one the next backward's, every step
    (the stale-reference test above checks the values this gives)."""
    for rank, steps in enumerate(run_ranks(_grad_buffers_per_step, 2, stage)):
        for before, after in zip(steps, steps[1:]):
            for (part, host), (part_next, host_next) in zip(before, after):
                assert part != host, f"rank {rank}: one buffer for reduction and update"
                assert (part_next, host_next) == (host, part), f"rank {rank}: buffers did not swap"


def _ranks_losses(rank, world, stage):
    return _delayed(rank, world, stage)[0]


def test_delayed_update_losses_follow_the_stale_params():
    """Each step's loss, averaged over ranks, is the reference's: the
    forward of step t really ran on the params of update t-2."""
    world = 2
    ref_losses, _ = _stale_reference(world)
    per_rank = run_ranks(_ranks_losses, world, 2)
    mean = [sum(x) / world for x in zip(*per_rank)]
    for step, (got, want) in enumerate(zip(mean, ref_losses)):
        assert math.isclose(got, want, rel_tol=1e-5), f"step {step + 1}: loss {got} vs {want}"


def _delayed_save_resume(rank, world, path):
    config = dict(stage=2, dtype="bf16", offload_optimizer="cpu", delayed_update=True, delayed_update_warmup=1)
    engine, _ = _wrap(config)
    _train(engine, rank, world, steps=3, accum=1)
    engine.save(path)  # with step 3's update still running on the host
    _train(engine, rank, world, steps=3, accum=1, first=3)
    continued = engine.full_state_dict()
    resumed, _ = _wrap(config)
    resumed.load(path)
    _train(resumed, rank, world, steps=3, accum=1, first=3)
    return continued, resumed.full_state_dict()


def test_delayed_update_resumes_from_a_checkpoint_exactly(tmp_path):
    for rank, (continued, resumed) in enumerate(run_ranks(_delayed_save_resume, 2, str(tmp_path / "ckpt"))):
        for k in continued:
            assert torch.equal(continued[k], resumed[k]), f"rank {rank}: {k} differs after resume"


def _nan_after_delayed_steps(rank, world):
    config = dict(stage=2, offload_optimizer="cpu", delayed_update=True, delayed_update_warmup=0)
    engine, _ = _wrap(config)
    _train(engine, rank, world, steps=3, accum=1)
    x, _ = lm_batch(3, 0, world)
    engine.backward(engine(local(x, rank, world)).sum() * float("nan"))
    try:
        engine.step()
    except zerocore.NonFiniteGradientError:
        raised = True
    else:
        raised = False
    engine.zero_grad()
    after = engine.full_state_dict()
    twin, _ = _wrap(config)
    _train(twin, rank, world, steps=3, accum=1)
    return raised, after, twin.full_state_dict()


def test_non_finite_grads_with_a_pending_update_keep_that_update_and_no_more():
    for rank, (raised, after, three_steps) in enumerate(run_ranks(_nan_after_delayed_steps, 2)):
        assert raised, f"rank {rank} did not raise"
        for k in three_steps:
            assert torch.equal(after[k], three_steps[k]), f"rank {rank}: {k}"


def _skip_after_delayed_steps(rank, world, stage):
    config = dict(stage=stage, dtype="fp16", offload_optimizer="cpu", delayed_update=True, delayed_update_warmup=0)
    engine, _ = _wrap(config)
    _train(engine, rank, world, steps=3, accum=1)
    x, _ = lm_batch(3, 0, world)
    engine.backward(engine(local(x, rank, world)).sum() * float("inf"))
    applied = engine.step()
    engine.zero_grad()
    with torch.no_grad():
        after = engine(local(x, rank, world))  # reads what the skipped step left on the device
    twin, _ = _wrap(config)
    _train(twin, rank, world, steps=3, accum=1)
    twin.finish_update()
    with torch.no_grad():
        three_steps = twin(local(x, rank, world))
    return applied, after, three_steps


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_skipped_fp16_step_lands_the_pending_update_for_the_next_forward(stage):
    """fp16 overflow with a delayed update pending: the native step skips
    the step on every rank and puts the pending update's params up (and
    gathers them), so the next forward computes with step 3's params."""
    for rank, (applied, after, three_steps) in enumerate(run_ranks(_skip_after_delayed_steps, 2, stage)):
        assert applied is False, f"rank {rank}: the overflowing step was applied"
        assert torch.equal(after, three_steps), f"rank {rank}: the forward after the skip read other params"


# Memory and copy volumes -------------------------------------------------
def _report(rank, world, config, accum):
    engine, _ = _wrap(config)
    _train(engine, rank, world, steps=1, accum=accum)
    engine.reset_comm_stats()
    _train(engine, rank, world, steps=1, accum=accum, first=1)
    pad = sum(g.plan.padding_elems for g in engine.groups if g.trainable)
    return engine.memory_report(), engine.comm_stats(), engine.num_trainable_params, pad


def _within(got, low, high, what):
    assert low <= got <= high, f"{what}: {got} not in [{low}, {high}]"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_by_device_and_copy_volume_match_the_formulas(stage):
    """bf16, AdamW, N ranks: on the device 2 bytes/param of params (stage 3:
    its shard, 2/N) and, in stage 1, the full grads (2); on the host, per
    param and rank, fp32 master + 2 moments (12/N), grads (2/N) and the
    16-bit copy of the new params (2/N). Per step and over all ranks: 2
    bytes/param of grads down for each backward (stage 1: once) and 2 up."""
    world, accum = 2, 2
    config = dict(stage=stage, dtype="bf16", offload_optimizer="cpu")
    results = run_ranks(_report, world, config, accum)
    for rank, (memory, _, numel, pad) in enumerate(results):
        device, host = memory["by_device"]["device"], memory["by_device"]["host"]
        full, part = (2 * numel, 2 * (numel + pad)), (2 * numel / world, 2 * (numel + pad) / world)
        _within(device["param"], *(part if stage == 3 else full), f"rank {rank} device params")
        _within(device["grad"], *(full if stage == 1 else (0, 0)), f"rank {rank} device grads")
        assert device["optim"] == 0, f"rank {rank}: optimizer state left on the device"
        _within(host["optim"], 6 * part[0], 6 * part[1], f"rank {rank} host optimizer state")
        _within(host["grad"], *part, f"rank {rank} host grads")
        _within(host["param"], *part, f"rank {rank} host param copy")
        for k in ("param", "grad", "optim"):
            assert memory[k] == device[k] + host[k]
    numel = results[0][2]
    down = sum(r[1]["offload"]["grad_bytes_to_host"] for r in results)
    up = sum(r[1]["offload"]["param_bytes_to_device"] for r in results)
    assert down == 2 * numel * (1 if stage == 1 else accum)
    assert up == 2 * numel


def _arena_growth(rank, world, config):
    import gc
    gc.collect()
    before = zerocore.host_arena_bytes()
    engine, _ = _wrap(config)
    grown = zerocore.host_arena_bytes() - before
    m = engine.memory_report()
    return grown, sum(m[k] for k in ("param", "grad", "optim")) + m["comm_buffers"]


@pytest.mark.parametrize("config", [dict(stage=3, dtype="fp16", offload_optimizer="cpu", offload_params="cpu"),
                                    dict(stage=1, offload_optimizer="cpu", delayed_update=True)])
def test_memory_report_is_what_the_arenas_hold(config):
    for rank, (grown, reported) in enumerate(run_ranks(_arena_growth, 2, config)):
        assert grown == reported, f"rank {rank}: arenas grew {grown}, the report says {reported}"


# Errors -----------------------------------------------------------------
@pytest.mark.parametrize("config,message", [
    (dict(stage=0, offload_optimizer="cpu"), "needs stage 1, 2 or 3"),
    (dict(stage=2, offload_optimizer="nvme"), "offload_optimizer='nvme'"),
    (dict(stage=2, offload_optimizer="cpu", offload_params="cpu"), "needs stage=3"),
    (dict(stage=3, offload_params="cpu"), "offload_optimizer=\"cpu\""),
    (dict(stage=2, delayed_update=True), "needs offload_optimizer"),
    (dict(stage=2, offload_optimizer="cpu", delayed_update="yes"), "delayed_update='yes'"),
    (dict(stage=2, offload_optimizer="cpu", delayed_update_warmup=-1), "delayed_update_warmup=-1"),
])
def test_bad_offload_config_names_the_field(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        zerocore.Config(**config)


def _short_of_host_memory(rank, world):
    if rank == 1:
        zerocore.state.offload.available_host_bytes = lambda: 10_000
    _wrap(dict(stage=2, offload_optimizer="cpu"))


def test_a_host_without_the_memory_fails_every_rank_at_wrap():
    results = run_ranks(_short_of_host_memory, 2, raise_errors=False)
    for r in results:
        assert isinstance(r, RankError) and r.exc_type == "MemoryError", r
        assert "bytes of host memory" in r.message and "10,000 are available" in r.message


def _allocation_fails_on_rank_1(rank, world):
    if rank == 1:
        def refuse(group):
            raise MemoryError(f"no memory for {group.plan.total_elems} elements")
        zerocore.flat_group.FlatGroup.allocate = refuse
    _wrap(dict(stage=3, offload_optimizer="cpu", offload_params="cpu"))


def test_an_allocation_that_fails_on_one_rank_fails_every_rank():
    r0, r1 = run_ranks(_allocation_fails_on_rank_1, 2, raise_errors=False)
    assert isinstance(r1, RankError) and r1.exc_type == "MemoryError" and "bytes on the host" in r1.message, r1
    assert isinstance(r0, RankError) and "failed on rank(s) [1]" in r0.message, r0
