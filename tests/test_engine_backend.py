"""The engine's backend is an object chosen per engine (zerocore/runtime/devices.py).

- An engine given a CheckingBackend of its own (wrap's backend=, not the
  ZEROCORE_BACKEND switch) runs everything on it in the CUDA path's stream
  layout (the compute stream, a comm stream per queue, offload's copy and
  update streams; the control group, a gloo group, beside the data group):
  stages 0-3 and offload on 2 gloo ranks match single-process torch, and
  the backend saw their host waits and found no violation.
- Two engines in one process run on their own backends, each seeing only
  its engine's work, and a backend lives as long as what was made on it.
- The CUDA path's decisions that need no GPU: which backend a device gets,
  the errors where CUDA is not built or not usable, a given backend that
  cannot run the module's device, a CUDA module without a process group.
  Where zerocore is built with CUDA, the CudaBackend chosen for cuda:k is
  made (which touches no CUDA) with torch's current stream as its compute
  stream, and poisons released memory only under ZEROCORE_CUDA_POISON=1.
  tests/test_gpu_engine.py has what needs a GPU.
"""
import gc

import pytest
import torch
import torch.distributed as dist

import zerocore
from dist_harness import run_ranks
from models import assert_state_close, engine_train, lm_batch, lm_loss, local, make, reference_train
from zerocore import _native
from zerocore.runtime import devices
from zerocore.comm.communicator import KINDS

STEPS, ACCUM = 3, 2
TINY = 256  # bytes a bucket: params straddle buckets and ranks
HP = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99))
CONFIGS = [dict(stage=s) for s in (0, 1, 2, 3)] + \
          [dict(stage=s, offload_optimizer="cpu") for s in (1, 2, 3)] + \
          [dict(stage=3, offload_optimizer="cpu", offload_params="cpu")]
CUDA_BUILT = hasattr(_native, "CudaBackend")
cuda_build = pytest.mark.skipif(not CUDA_BUILT, reason="zerocore built without CUDA")
cpu_build = pytest.mark.skipif(CUDA_BUILT, reason="zerocore built with CUDA")


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), **HP)


def _reference():
    model = make()
    return reference_train(model, _adamw(model), STEPS, ACCUM, 2)


def _on_a_checker_of_its_own(rank, world, seed):
    out = []
    default = _native.process_backend()
    default_waits = default.host_waits() if isinstance(default, _native.CheckingBackend) else None
    for config in CONFIGS:
        checker = _native.CheckingBackend(seed=seed + rank, throw_on_violation=False)
        model = make()
        engine = zerocore.wrap(model, _adamw(model), zerocore.Config(bucket_bytes=TINY, **config), backend=checker)
        queues = [engine.comm.queue, engine.control.queue] + ([engine.rounds_comm.queue] if engine.scheduler else [])
        layout = (engine.backend is checker and all(q.backend is checker for q in queues),
                  dist.get_backend(engine.control.group), engine.control.group is not engine.comm.group)
        state = engine_train(engine, rank, world, STEPS, ACCUM)
        engine.close()
        out.append((config, state, layout, checker.violations(), checker.host_waits()))
    # Nothing ran on the process's backend (under ZEROCORE_BACKEND=checking, a checker that counts).
    default_unused = default_waits is None or default.host_waits() == default_waits
    return out, default_unused


def test_a_given_checking_backend_runs_every_stage_in_the_cuda_layout_with_no_violation(gen):
    seed = int(torch.randint(2**31, (), generator=gen))
    ref = _reference()
    for rank, (runs, default_unused) in enumerate(run_ranks(_on_a_checker_of_its_own, 2, seed, timeout=180)):
        assert default_unused, f"rank {rank}: the process's default backend was used"
        for config, state, layout, violations, host_waits in runs:
            what = f"rank {rank} {config}"
            assert layout == (True, "gloo", True), f"{what}: queues on the given backend, the control group " \
                                                   f"gloo beside the data group: {layout}"
            assert violations == [], f"{what}: {violations}"
            assert host_waits >= STEPS, f"{what}: the step's exchange waits went elsewhere ({host_waits})"
            assert_state_close(state, ref, rtol=1e-5, atol=1e-6, what=what)


def _two_engines(rank, world):
    """Stage 3 on one checker and stage 1 on another, stepped in turn: each
    step's host waits land on its own engine's backend only."""
    first = _native.CheckingBackend(seed=rank, throw_on_violation=False)
    a_model, b_model = make(), make()
    a = zerocore.wrap(a_model, _adamw(a_model), zerocore.Config(stage=3, bucket_bytes=TINY), backend=first)
    b = zerocore.wrap(b_model, _adamw(b_model), zerocore.Config(stage=1, bucket_bytes=TINY),
                      backend=_native.CheckingBackend(seed=rank + 7, throw_on_violation=False))
    second = b.backend
    assert second is not first and b.comm.queue.backend is second and a.comm.queue.backend is first
    waits = []
    for step in range(STEPS):
        for engine in (a, b):
            for micro in range(ACCUM):
                x, y = lm_batch(step, micro, world)
                engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
            first.take_host_waits(), second.take_host_waits()
            engine.step()
            waits.append((first.take_host_waits(), second.take_host_waits()))
            engine.zero_grad()
    out = [a.full_state_dict(), b.full_state_dict()]
    violations = first.violations() + second.violations()
    a.close(), b.close()
    return out, waits, violations


def test_two_engines_in_one_process_run_on_their_own_backends():
    ref = _reference()
    for rank, (states, waits, violations) in enumerate(run_ranks(_two_engines, 2, timeout=120)):
        assert violations == [], violations
        for which, state in zip(("stage 3", "stage 1"), states):
            assert_state_close(state, ref, rtol=1e-5, atol=1e-6, what=f"rank {rank} {which}")
        stage3_steps, stage1_steps = waits[0::2], waits[1::2]
        assert all(mine > 0 and other == 0 for mine, other in stage3_steps), waits
        assert all(other == 0 and mine > 0 for other, mine in stage1_steps), waits


def test_a_backend_outlives_what_was_made_on_it(gen):
    """No name keeps the backends below: the queue, its event and the store
    do, so each goes on working."""
    queue = _native.CommQueue.single_process(_native.CheckingBackend())
    plan = zerocore.LayoutPlan.make([5, 7], world_size=1, align_elems=1, bucket_elems=8)
    store = zerocore.PartitionStore(plan, backend=_native.CheckingBackend(), rank=0, dtype="fp32",
                                    reduce_dtype="fp32", trainable=True, sharded=False, partitions_grads=False,
                                    params_on_host=False, optimizer_on_host=False)
    gc.collect()
    backend = queue.backend
    assert isinstance(backend, _native.CheckingBackend)
    store.allocate()
    full = torch.from_dlpack(store.buffer("full"))
    values = torch.randn(full.numel(), generator=gen)
    event = queue.all_gather((KINDS.index("all_gather"), 0, 0, full.numel()), values, full)
    queue.close()
    del queue, backend
    gc.collect()
    event.compute_waits()
    assert torch.equal(full, values)


def test_compute_waits_orders_torch_after_the_collective(gen):
    """Event.compute_waits is the compute stream's wait: a read on it after
    the wait is ordered, one before is named."""
    backend = _native.CheckingBackend(seed=int(torch.randint(2**31, (), generator=gen)))
    queue = _native.CommQueue.single_process(backend)
    out = torch.from_dlpack(backend.allocate("device", 64 * 4, "gathered").view(0, "float32", [64]))
    key = (KINDS.index("all_gather"), 0, 0, 64)
    queue.all_gather(key, torch.randn(64, generator=gen), out).compute_waits()
    backend.declare_access(backend.compute_stream(), out, "read", "torch reads the gathered values")
    event = queue.all_gather(key, torch.randn(64, generator=gen), out)
    with pytest.raises(_native.StreamOrderError, match="torch reads the gathered values"):
        backend.declare_access(backend.compute_stream(), out, "read", "torch reads the gathered values")
    event.wait()
    assert backend.host_waits() == 1  # compute_waits is a stream wait, not a host wait
    queue.close()


# Which backend and device wrap decides on ------------------------------------

CPU, META = torch.device("cpu"), torch.device("meta")


def test_a_cpu_module_runs_on_the_process_backend_or_the_one_given():
    for tensors in ([("w", CPU), ("b", META)], [("w", META)], []):
        where = devices.decide(tensors)
        assert (where.device, where.backend, where.problem) == (CPU, _native.process_backend(), None)
    mine = _native.CpuBackend()
    assert devices.decide([("w", CPU)], mine).backend is mine
    where = devices.decide([("w", CPU)], "cpu")
    assert "backend= takes a zerocore._native.Backend" in where.problem and "got str" in where.problem
    assert where.backend is _native.process_backend()


def test_wraps_device_says_where_a_meta_module_trains():
    where = devices.decide([("w", META)], meta_device="cpu")
    assert (where.device, where.problem) == (CPU, None)
    for bad, says in [("mps", "device='mps': zerocore trains on cpu"), (3.5, "device= takes a torch.device")]:
        assert says in devices.decide([("w", META)], meta_device=bad).problem
    if devices.SUPPORTED == ("cpu",):
        assert "device='cuda:0': zerocore trains on cpu devices" in \
            devices.decide([("w", META)], meta_device="cuda:0").problem


@cuda_build
def test_a_meta_module_trains_on_the_cuda_device_wrap_is_given(monkeypatch):
    monkeypatch.setattr(devices, "cuda_usable", lambda: True)
    monkeypatch.setattr(devices, "current_stream", lambda device: 0x1000 + device.index)
    where = devices.decide([("w", META), ("b", META)], meta_device="cuda:1")
    assert where.problem is None and where.device == torch.device("cuda", 1) and where.backend.device == 1
    assert devices.decide(_gpu_tensors(1) + [("head.weight", META)], meta_device=torch.device("cuda", 1)).problem \
        is None
    problem = devices.decide(_gpu_tensors(0) + [("head.weight", META)], meta_device="cuda:1").problem
    assert "head.weight (meta) on cuda:1" in problem and "materialised on cuda:1 (wrap's device=)" in problem
    monkeypatch.setattr(devices, "cuda_usable", lambda: False)
    assert "device='cuda:0', but" in devices.decide([("w", META)], meta_device="cuda:0").problem


def _gpu_tensors(index=0):
    return [("blocks.0.up.weight", torch.device("cuda", index)), ("blocks.0.norm.running", torch.device("cuda", index))]


@cpu_build
def test_a_cuda_module_is_refused_where_cuda_is_not_built():
    assert devices.SUPPORTED == ("cpu",) and not devices.cuda_usable()
    where = devices.decide(_gpu_tensors())
    assert where.backend is _native.process_backend() and where.device == CPU
    assert "blocks.0.up.weight (cuda:0), blocks.0.norm.running (cuda:0) are not on the CPU" in where.problem
    assert "built without its CUDA backend" in where.problem and "ZEROCORE_CUDA=ON" in where.problem


@cuda_build
def test_a_cuda_module_is_refused_where_torch_cannot_use_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.SUPPORTED == ("cpu", "cuda") and not devices.cuda_usable()
    where = devices.decide(_gpu_tensors())
    assert where.backend is _native.process_backend()
    assert "are not on the CPU" in where.problem and "torch.cuda.is_available() is False" in where.problem


@cuda_build
def test_a_cuda_module_runs_on_a_cuda_backend_of_its_device_on_torchs_stream(monkeypatch):
    monkeypatch.setattr(devices, "cuda_usable", lambda: True)
    monkeypatch.setattr(devices, "current_stream", lambda device: 0x1000 + device.index)
    where = devices.decide(_gpu_tensors(1))
    assert where.problem is None and where.device == torch.device("cuda", 1)
    assert isinstance(where.backend, _native.CudaBackend) and isinstance(where.backend, _native.Backend)
    assert where.backend.device == 1 and where.backend.stream_handle(where.backend.compute_stream()) == 0x1001
    assert devices.is_cuda(where.backend) and not devices.is_cuda(_native.process_backend())
    assert not where.backend.poison_released  # a debug option (ZEROCORE_CUDA_POISON=1): off
    assert _native.CudaBackend(1, 0x1001, poison_released=True).poison_released
    given = _native.CudaBackend(1)
    assert devices.decide(_gpu_tensors(1), given).backend is given
    assert "must be a CudaBackend of device 1, got a CudaBackend of cuda:0" in \
        devices.decide(_gpu_tensors(1), _native.CudaBackend(0)).problem
    assert "must be a CudaBackend of device 0, got a CheckingBackend" in \
        devices.decide(_gpu_tensors(0), _native.CheckingBackend()).problem
    assert "must be a CPU backend (CpuBackend or CheckingBackend), got a CudaBackend of cuda:0" in \
        devices.decide([("w", CPU)], _native.CudaBackend(0)).problem


def test_zerocore_cuda_poison_turns_the_cuda_backends_poisoning_on(monkeypatch):
    made = []
    monkeypatch.setattr(devices, "cuda_usable", lambda: True)
    monkeypatch.setattr(devices, "current_stream", lambda device: 0x1000)
    monkeypatch.setattr(_native, "CudaBackend", lambda *args, **kw: made.append((args, kw)), raising=False)
    for value, poison in [(None, False), ("0", False), ("1", True)]:
        if value is None:
            monkeypatch.delenv("ZEROCORE_CUDA_POISON", raising=False)
        else:
            monkeypatch.setenv("ZEROCORE_CUDA_POISON", value)
        devices.decide(_gpu_tensors(1))
        assert made.pop() == ((1, 0x1000), {"poison_released": poison}), value
    monkeypatch.setenv("ZEROCORE_CUDA_POISON", "yes")
    with pytest.raises(ValueError, match=r"ZEROCORE_CUDA_POISON='yes': set it to 1 .* or to 0"):
        devices.decide(_gpu_tensors(1))


def test_a_module_on_two_devices_is_refused(monkeypatch):
    monkeypatch.setattr(devices, "cuda_usable", lambda: True)
    monkeypatch.setattr(devices, "_backend_for", lambda device: pytest.fail("no backend for a refused module"))
    for tensors, where in [(_gpu_tensors(0) + [("embed.weight", CPU)], "embed.weight (cpu) on cpu"),
                           (_gpu_tensors(0) + _gpu_tensors(1)[:1], "blocks.0.up.weight (cuda:1) on cuda:1"),
                           (_gpu_tensors(0) + [("head.weight", META)], "head.weight (meta) on cpu")]:
        problem = devices.decide(tensors).problem
        assert "on more than one device" in problem and where in problem and "model.to(device)" in problem


def test_the_group_must_move_the_modules_device():
    assert devices.group_problem(("cpu", "cuda"), "cpu:gloo,cuda:nccl", "cuda") is None
    problem = devices.group_problem(("cpu",), "gloo", "cuda")
    assert "(gloo) cannot move cuda tensors" in problem and "cpu:gloo,cuda:nccl" in problem
    assert devices.missing_group_problem(CPU) is None
    problem = devices.missing_group_problem(torch.device("cuda", 0))
    assert "on cuda:0" in problem and "init_process_group" in problem
