"""Model-state memory and communication volume equal the ZeRO formulas
(zerocore.sizing.accounting, docs/formulas.md) up to alignment padding, and
memory_report() is the memory the engine's backend holds."""
import gc

import pytest
import torch

import zerocore
from backend_bytes import assert_report_is_the_backends
from dist_harness import run_ranks
from models import lm_batch, lm_loss, local, make
from zerocore import _native
from zerocore.sizing import accounting

KEYS = ("param", "grad", "optim")


def measure(rank, world, dtype, accum):
    out = {}
    for stage in range(4):
        model = make(layers=3)
        gc.collect()  # the last stage's engine (a module-engine cycle) must not be freed mid-measurement
        arena_before = zerocore.host_arena_bytes()
        engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               zerocore.Config(stage=stage, dtype=dtype, persist_threshold=0, bucket_bytes=1024))
        arena = zerocore.host_arena_bytes() - arena_before
        memory_at_wrap = engine.memory_report()
        for step in range(3):
            if step == 1:
                # One step's volume, in steady state: stage 3's step gathers what
                # the next forward starts with, so the first step moves less.
                engine.reset_comm_stats()
            for micro in range(accum):
                x, y = lm_batch(step, micro, world)
                engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
            engine.step()
            engine.zero_grad()
            if step == 1:
                comm = engine.comm_stats()
        out[stage] = dict(memory=engine.memory_report(), memory_at_wrap=memory_at_wrap, arena=arena, comm=comm,
                          numel=engine.num_trainable_params, padding=engine.padding_elems, root=engine.root_numel)
    return out


def within(measured, low, high, what):
    assert low <= measured <= high, f"{what}: measured {measured}, formula {low} (up to padding: {high})"


@pytest.mark.parametrize("world,dtype,accum", [(2, "bf16", 1), (4, "bf16", 2), (2, "fp32", 2), (1, "fp32", 1)])
def test_memory_and_comm_match_formulas(world, dtype, accum):
    results = run_ranks(measure, world, dtype, accum, timeout=120)
    state_bytes = accounting.optimizer_state_bytes("adamw", dtype)
    for rank, per_stage in enumerate(results):
        for stage, r in per_stage.items():
            numel, padded = r["numel"], r["numel"] + r["padding"]
            lo = accounting.predicted_memory(stage, numel, world, dtype, state_bytes)
            hi = accounting.predicted_memory(stage, padded, world, dtype, state_bytes)
            for k in KEYS:
                within(r["memory"][k], lo[k], hi[k], f"rank {rank} stage {stage} {k} memory")
            # The report is what the native arenas really hold, all of it
            # allocated at wrap: model states and the buffers collectives use.
            held = sum(r["memory"][k] for k in KEYS) + r["memory"]["comm_buffers"]
            assert r["arena"] == held, f"stage {stage}: arenas disagree with report"
            assert r["memory"] == r["memory_at_wrap"], f"stage {stage}: memory allocated after wrap"
            lo_c = accounting.predicted_comm(stage, numel, accum, r["root"])
            hi_c = accounting.predicted_comm(stage, padded, accum, r["root"])
            for k in lo_c:
                within(r["comm"][k], lo_c[k], hi_c[k], f"rank {rank} stage {stage} {k} elements")


def test_stage3_memory_shrinks_with_world_size():
    one = run_ranks(measure, 1, "bf16", 1)[0]
    four = run_ranks(measure, 4, "bf16", 1)[0]
    for k in KEYS:
        assert four[3]["memory"][k] * 4 <= one[3]["memory"][k] + 4 * 2 * four[3]["padding"] * 12
        assert four[3]["memory"][k] < one[3]["memory"][k]


def _freed_after_del(rank, world):
    out = []
    for stage in range(4):
        gc.collect()  # engines of earlier tests in the forking process, cycles, must go before the base is taken
        base = zerocore.host_arena_bytes()
        model = make()
        engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters()), {"stage": stage})
        x, y = lm_batch(0, 0, world)
        engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
        engine.step()
        held = zerocore.host_arena_bytes() - base
        del engine, model
        gc.collect()
        out.append((held, zerocore.host_arena_bytes() - base))
    return out


def test_engine_memory_is_freed_when_dropped():
    for held, left in run_ranks(_freed_after_del, 2)[0]:
        assert held > 0 and left == 0


OFFLOADS = [dict(stage=s) for s in (0, 1, 2, 3)] + \
           [dict(stage=s, offload_optimizer="cpu") for s in (1, 2, 3)] + \
           [dict(stage=3, offload_optimizer="cpu", offload_params="cpu")]


def _report_and_backend(rank, world, dtype, backend_class):
    """Each config on a backend of its own: what the report says and what
    the backend holds at wrap, after steps and once the engine is closed;
    and the host arenas wrap made (on a CPU backend every buffer is one)."""
    out = []
    for config in OFFLOADS:
        backend = getattr(_native, backend_class)()
        model = make()
        gc.collect()
        arena_before = zerocore.host_arena_bytes()
        engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               zerocore.Config(dtype=dtype, bucket_bytes=256, **config), backend=backend)
        at_wrap = (engine.memory_report(), backend.allocated_bytes(), zerocore.host_arena_bytes() - arena_before)
        after_steps = []
        for step in range(3):
            for micro in range(2):
                x, y = lm_batch(step, micro, world)
                engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
            engine.step()
            engine.zero_grad()
            after_steps.append((engine.memory_report(), backend.allocated_bytes()))
        engine.close()
        del engine
        gc.collect()
        out.append((config, at_wrap, after_steps, backend.allocated_bytes()))
    return out


@pytest.mark.parametrize("dtype,backend_class", [("fp32", "CpuBackend"), ("bf16", "CheckingBackend")])
def test_memory_report_is_what_the_backend_holds(dtype, backend_class):
    """The report's device and host bytes, less what is torch's (the
    module's buffers, checkpoint buffers), are the backend's buffers of
    those kinds; every native arena wrap makes is one of them; steps
    allocate nothing (no unit here diverges, so stage 3's pool never grows);
    and close() leaves the backend holding nothing."""
    for rank, runs in enumerate(run_ranks(_report_and_backend, 2, dtype, backend_class, timeout=180)):
        for config, (report, allocated, arenas), after_steps, closed in runs:
            what = f"rank {rank} {dtype} {config}"
            assert_report_is_the_backends(report, allocated, f"{what} at wrap")
            assert arenas == sum(allocated.values()), f"{what}: wrap made {arenas} bytes of host arenas, " \
                                                      f"its backend holds {allocated}"
            assert allocated["host_pageable"] == 0, f"{what}: the runtime asks for pinned or device memory"
            # Pinned: the step's exchange row (a few doubles), and with offload the host's model states.
            row = report["by_device"]["host"]["comm_buffers"]
            assert 0 < row < 1024, f"{what}: the step's exchange row is {row} bytes"
            assert (allocated["host_pinned"] > row) == ("offload_optimizer" in config), f"{what}: {allocated}"
            for step, (report_then, allocated_then) in enumerate(after_steps):
                assert (report_then, allocated_then) == (report, allocated), \
                    f"{what}: step {step} changed the memory: {report_then}, {allocated_then}"
            assert closed == {"host_pageable": 0, "host_pinned": 0, "device": 0}, f"{what}: left after close(): {closed}"
