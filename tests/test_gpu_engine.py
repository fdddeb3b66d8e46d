"""The engine on a CUDA device (issue 21): training at world size 1 against
single-process torch on the same GPU, for every stage and dtype, with
offload, with partitioned activation checkpoints and under side streams
(against the default stream's); memory_report() against the bytes of the
CUDA backend's device and pinned arenas.

All of it is marked `gpu` and skipped without a CUDA device and a CUDA
build; `bash tests/gpu.sh` runs it on a GPU machine. Each test makes a
world-size-1 group the way a GPU user does ("cpu:gloo,cuda:nccl": the
control plane on gloo, the data plane on NCCL) in this process, since
forked ranks cannot use CUDA. The references are the CPU tests' own
(models.reference_train, mixed_precision_reference), run on the GPU.

wrap puts a CUDA module on a CudaBackend of its device, torch's current
stream its compute stream (zerocore/runtime/devices.py; a stream made current
between steps is followed, zerocore/runtime/compute_stream.py: checked here under
side streams), with the data plane on NCCL and the control plane on gloo
groups beside it. tests/gpu.sh runs these with ZEROCORE_CUDA_POISON=1, so
that a read of a released slot or staging range shows as NaN. The native
step's norm and update are the backend's kernels. These are the engine's
acceptance tests on a GPU (issue 21; docs/status.md says where they ran).
With the group made on gloo, the device on the CPU and one torch thread,
the same tests pass on the CPU (checked by hand when they were written), so
what they compare is known to hold where the engine runs.
"""
import copy
import gc

import pytest
import torch
import torch.distributed as dist

import zerocore
import zerocore.cuda
from zerocore.io.safetensors_file import Reader
from backend_bytes import assert_report_is_the_backends
from mixed_precision_reference import assert_moved_like, mp_reference_train
from models import TinyLM, assert_state_close, engine_train, lm_batch, lm_loss, make, reference_train

STEPS, ACCUM = 4, 2
STAGES = (0, 1, 2, 3)
HP = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and zerocore.cuda.is_available()),
                       reason="needs a CUDA device and zerocore built with CUDA"),
]


@pytest.fixture
def world1(tmp_path):
    """A world of one rank on cuda:0, as a GPU user makes it."""
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    yield torch.device("cuda", 0)
    dist.destroy_process_group()


def on(device):
    """lm_batch on `device`."""
    return lambda step, micro, world: tuple(t.to(device) for t in lm_batch(step, micro, world))


def adamw(params):
    return torch.optim.AdamW(params, **HP)


def test_wrap_runs_a_cuda_module_on_a_cuda_backend_beside_a_gloo_control_plane(world1):
    model = make().to(world1)
    engine = zerocore.wrap(model, adamw(model.parameters()), zerocore.Config(stage=1, offload_optimizer="cpu"))
    backend = engine.backend
    assert isinstance(backend, zerocore._native.CudaBackend) and backend.device == world1.index
    assert backend.stream_handle(backend.compute_stream()) == torch.cuda.current_stream(world1).cuda_stream
    assert engine.comm.queue.backend is backend and engine.control.queue.backend is backend
    assert dist.get_backend(engine.control.group) == "gloo"
    assert "nccl" in dist.get_backend_config(engine.comm.group)
    engine.close()


def train(device, config, model=None):
    model = model or make().to(device)
    engine = zerocore.wrap(model, adamw(model.parameters()), config)
    state = engine_train(engine, 0, 1, STEPS, ACCUM, batch=on(device))
    engine.close()
    return {k: v.cpu() for k, v in state.items()}


def fp32_reference(device):
    model = make().to(device)
    state = reference_train(model, adamw(model.parameters()), STEPS, ACCUM, 1, batch=on(device))
    return {k: v.cpu() for k, v in state.items()}


@pytest.mark.parametrize("stage", STAGES)
def test_deterministic_mode_on_the_gpu(world1, stage, monkeypatch):
    """Config(deterministic=True) (docs/deterministic.md): the same bits
    whichever order a step's micro-batches run in, and their mean grad,
    against torch on the same GPU with each loss divided by their count."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # torch's deterministic cuBLAS
    torch.use_deterministic_algorithms(True)  # each micro-batch's backward the same bits in any run
    try:
        config = zerocore.Config(stage=stage, bucket_bytes=256, deterministic=True)

        def run(order):
            model = make().to(world1)
            engine = zerocore.wrap(model, adamw(model.parameters()), config)
            state = engine_train(engine, 0, 1, STEPS, ACCUM,
                                 batch=lambda step, micro, world: on(world1)(step, order[micro], world))
            engine.close()
            return {k: v.cpu() for k, v in state.items()}

        got, backwards = run(list(range(ACCUM))), run(list(range(ACCUM))[::-1])
        assert got.keys() == backwards.keys() and all(torch.equal(got[k], backwards[k]) for k in got)
        model = make().to(world1)
        ref = reference_train(model, adamw(model.parameters()), STEPS, ACCUM, 1, batch=on(world1),
                              loss_fn=lambda out, y: lm_loss(out, y) / ACCUM)
        assert_state_close(got, {k: v.cpu() for k, v in ref.items()}, rtol=1e-5, atol=1e-6, what=f"stage {stage}")
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("stage", STAGES)
def test_fp32_matches_torch_on_the_same_gpu(world1, stage):
    got = train(world1, zerocore.Config(stage=stage, bucket_bytes=256))
    assert_state_close(got, fp32_reference(world1), rtol=1e-5, atol=1e-6, what=f"stage {stage}")


# The CPU suite's bounds (test_mixed_precision.py): a share of each param's
# movement; fp32 reduction 1e-4, fp16 with dynamic scaling 5e-3.
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("dtype,config,bound", [
    ("bf16", {"reduce_dtype": "fp32"}, 1e-4),
    ("fp16", {"loss_scale": zerocore.DynamicLossScale(initial=2.0**10, window=2)}, 5e-3),
])
def test_16_bit_matches_mixed_precision_torch(world1, stage, dtype, config, bound):
    model = make().to(world1)
    initial = {k: v.cpu() for k, v in model.state_dict().items()}
    reference_model = copy.deepcopy(model)
    ref_opt = adamw(reference_model.parameters())
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2) if dtype == "fp16" else None
    ref, _ = mp_reference_train(reference_model, ref_opt, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype],
                                STEPS, ACCUM, 1, scaler=scaler, batch=on(world1))
    got = train(world1, zerocore.Config(stage=stage, dtype=dtype, bucket_bytes=256, **config), model=model)
    assert_moved_like(got, {k: v.cpu() for k, v in ref.items()}, initial, bound, what=f"stage {stage} {dtype}")


@pytest.mark.parametrize("stage,offload_params", [(1, None), (2, None), (3, None), (3, "cpu")])
def test_offload_matches_torch(world1, stage, offload_params):
    config = zerocore.Config(stage=stage, bucket_bytes=256, offload_optimizer="cpu", offload_params=offload_params)
    assert_state_close(train(world1, config), fp32_reference(world1), rtol=1e-5, atol=1e-6,
                       what=f"stage {stage} offload_params={offload_params}")


@pytest.mark.parametrize("stage,offload", [(1, {}), (3, {}), (3, dict(offload_optimizer="cpu", offload_params="cpu"))])
def test_a_meta_model_trains_on_the_gpu_wrap_is_given(world1, stage, offload):
    """Built inside zerocore.init() and wrapped with device=: its values
    are eager construction's (make()'s seed) and it trains on the GPU as
    the same model built there does, the params never whole on the GPU."""
    torch.manual_seed(0)  # make()'s
    with zerocore.init():
        model = TinyLM()
    config = zerocore.Config(stage=stage, bucket_bytes=256, **offload)
    engine = zerocore.wrap(model, adamw(model.parameters()), config, device="cuda")
    assert engine.device == world1 and isinstance(engine.backend, zerocore._native.CudaBackend)
    got = {k: v.cpu() for k, v in engine_train(engine, 0, 1, STEPS, ACCUM, batch=on(world1)).items()}
    engine.close()
    assert_state_close(got, train(world1, config), rtol=1e-5, atol=1e-6, what=f"stage {stage} {offload}")


@pytest.mark.parametrize("stage", STAGES)
def test_training_under_side_streams_matches_the_default_stream(world1, stage):
    """Each step under a stream of its own (with torch.cuda.stream(s) around
    its forwards, backwards and step): the engine adopts it at the step's
    first forward, the new stream waiting for the runtime's work on the one
    before (the wrap's, then the last step's), so the result is the
    default stream's."""
    config = zerocore.Config(stage=stage, bucket_bytes=256)
    expected = train(world1, config)
    model = make().to(world1)
    engine = zerocore.wrap(model, adamw(model.parameters()), config)
    backend, batch = engine.backend, on(world1)
    sides = (torch.cuda.Stream(world1), torch.cuda.Stream(world1))
    for step in range(STEPS):
        side = sides[step % 2]
        with torch.cuda.stream(side):
            for micro in range(ACCUM):
                x, y = batch(step, micro, 1)
                engine.backward(lm_loss(engine(x), y))
            engine.step()
            engine.zero_grad()
        assert backend.stream_handle(backend.compute_stream()) == side.cuda_stream
    with torch.cuda.stream(side):  # the engine's last stream: stage 3 gathers on it
        got = {k: v.cpu() for k, v in engine.full_state_dict().items()}
    engine.close()
    assert_state_close(got, expected, rtol=1e-5, atol=1e-6, what=f"stage {stage} under side streams")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("config", [dict(stage=s) for s in STAGES] +
                         [dict(stage=s, offload_optimizer="cpu") for s in (1, 2, 3)] +
                         [dict(stage=3, offload_optimizer="cpu", offload_params="cpu")])
def test_memory_report_is_the_cuda_backends_arenas(world1, config, dtype):
    """What the report puts on the device and the host is what the engine's
    CudaBackend holds in cudaMalloc and pinned (or, where pinning failed,
    pageable) buffers, allocated at wrap and not per step; close() frees
    all of it (tests/backend_bytes.py; the CPU backends' test is in
    test_engine_accounting.py)."""
    what = f"{config} {dtype}"
    model = make().to(world1)
    engine = zerocore.wrap(model, adamw(model.parameters()), zerocore.Config(dtype=dtype, bucket_bytes=256, **config))
    backend = engine.backend
    report, allocated = engine.memory_report(), backend.allocated_bytes()
    assert_report_is_the_backends(report, allocated, f"{what} at wrap")
    # On the host: the step's exchange row (pinned, a few bytes) always; model states with offload only.
    host_states = sum(n for k, n in report["by_device"]["host"].items() if k not in ("comm_buffers", "activations"))
    assert allocated["device"] > 0 and (host_states > 0) == ("offload_optimizer" in config), f"{what}: {report}"
    assert 0 < report["by_device"]["host"]["comm_buffers"] <= allocated["host_pinned"] + allocated["host_pageable"]
    engine_train(engine, 0, 1, STEPS, ACCUM, batch=on(world1))
    assert (engine.memory_report(), backend.allocated_bytes()) == (report, allocated), f"{what}: steps allocated"
    engine.close()
    del engine
    gc.collect()
    assert backend.allocated_bytes() == {"host_pageable": 0, "host_pinned": 0, "device": 0}, f"{what}: left"


class CheckpointedLM(TinyLM):
    """TinyLM with each block checkpointed by zerocore.checkpoint (Pa; with
    offload="cpu", Pa+cpu: the slices in pinned host memory, copied on a
    copy stream)."""

    def __init__(self, offload=None):
        super().__init__()
        self.offload = offload

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.blocks:
            x = zerocore.checkpoint(b, x, group=dist.group.WORLD, offload=self.offload)
        return self.head(self.norm(x))


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_partitioned_activation_checkpoints_match_torch(world1, offload):
    model = make(CheckpointedLM, offload=offload).to(world1)  # the same init as make(): the same params
    got = train(world1, zerocore.Config(stage=3, bucket_bytes=256), model=model)
    assert_state_close(got, fp32_reference(world1), rtol=1e-5, atol=1e-6, what=f"Pa offload={offload}")


@pytest.mark.parametrize("stage,offload", [(s, None) for s in STAGES] + [(3, "cpu")])
def test_save_load_and_export_of_a_cuda_engine(world1, tmp_path, stage, offload):
    """A CUDA engine saved after 2 steps and loaded into a fresh one ends 2
    steps later exactly where the uninterrupted run does; the export loads
    into a plain model as the engine's full state (read with zerocore's own
    reader: a GPU machine's python may lack the safetensors package; the
    CPU test reads exports with that package)."""
    config = zerocore.Config(stage=stage, bucket_bytes=256, offload_optimizer=offload)

    def fresh():
        model = make().to(world1)
        return zerocore.wrap(model, adamw(model.parameters()), config)

    def train_steps(engine, first, count):
        for step in range(first, first + count):
            for micro in range(ACCUM):
                x, y = on(world1)(step, micro, 1)
                engine.backward(lm_loss(engine(x), y))
            engine.step()
            engine.zero_grad()

    path, out = str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")
    engine = fresh()
    train_steps(engine, 0, 2)
    engine.save(path)
    saved = {k: v.cpu() for k, v in engine.full_state_dict().items()}
    train_steps(engine, 2, 2)
    uninterrupted = {k: v.cpu() for k, v in engine.full_state_dict().items()}
    engine.close()
    resumed = fresh()
    resumed.load(path)
    train_steps(resumed, 2, 2)
    got = {k: v.cpu() for k, v in resumed.full_state_dict().items()}
    resumed.close()
    assert_state_close(got, uninterrupted, rtol=0, atol=0, what=f"stage {stage} offload={offload} resumed")
    zerocore.io.export(path, out)
    plain = make()
    with Reader(out) as exported:
        plain.load_state_dict({name: exported.get(name) for name in exported.entries}, strict=True)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, saved[k]), k
