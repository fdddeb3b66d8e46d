"""Several ranks on one GPU: the multi-rank CUDA engine on the single-GPU
machines this project gets (`pytest -m gpu`; skipped without a device).

Every rank trains on cuda:0 in a process of its own, started with spawn (a
forked child cannot use CUDA), over each data plane of gpu_data_planes.py:
a gloo data group (gloo moves CUDA tensors through pinned host memory, and
the transport reduce-scatters them with gloo's tensor collective: it has no
send or recv for them), torch's NCCL group and zerocore's native NCCL
transport, the last two where the machine's NCCL allows several ranks on
one GPU (2.30 and later; skipped naming the version otherwise). So the code
that runs only at world size > 1 on a GPU runs here: rank offsets into
device buffers, real cross-rank sums in device memory, stage 3's rounds at
world 2 and 4, the lend path, a dead peer, a checkpoint saved at one world
size and loaded at another, accumulation with clipping, partitioned
activation checkpoints over the ranks' group, and rank 0 alone in
full_state_dict() found within seconds on every rank (its gathers on the
device, the host waits watched). tests/gpu.sh runs them under
ZEROCORE_CUDA_POISON=1 (released memory reads as NaN), which the spawned
ranks inherit. References: single-process torch on the same GPU, as in the
CPU suite. What one GPU cannot show: device-index bugs (every rank is
cuda:0), NCCL's own paths between GPUs, and speed.
"""
import functools
import os

import pytest
import torch

import test_activation_checkpoint
import test_grad_scale
import test_rank_disagreement_device
import test_snapshots
import zerocore
import zerocore.cuda
from dist_harness import run_ranks
from gpu_data_planes import PLANES, skip_reason
from mixed_precision_reference import assert_moved_like, mp_reference_train
from models import assert_state_close, engine_train, lm_batch, lm_loss, local, make, reference_train
from test_divergent_units import DataRouted, assert_as_close_as_torch, random_codes, routed
from zerocore.io import snapshot_transport

STEPS, ACCUM = 3, 2
STAGES = (0, 1, 2, 3)
HP = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99))
TIMEOUT = 300  # each test's ranks: CUDA start-up and gloo's staging on a shared GPU

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and zerocore.cuda.is_available()),
                       reason="needs a CUDA device and zerocore built with CUDA"),
]


@pytest.fixture(params=PLANES, ids=lambda plane: plane.name)
def plane(request, monkeypatch):
    """The data plane the ranks train over; its environment set here, which
    the spawned ranks inherit."""
    reason = skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    for name, value in request.param.env.items():
        monkeypatch.setenv(name, value)
    return request.param


def _gpu():
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _on(device, batch=lm_batch):
    return lambda step, micro, world: tuple(t.to(device) for t in batch(step, micro, world))


def _adamw(params):
    return torch.optim.AdamW(params, **HP)


def _cpu(state):
    return {k: v.cpu() for k, v in state.items()}


def _train(rank, world, configs, model_fn=make, batch=lm_batch):
    """Each Config in `configs` trained on this rank's part of the batches,
    on cuda:0; the full states, on the host."""
    device = _gpu()
    out = []
    for config in configs:
        model = model_fn().to(device)
        engine = zerocore.wrap(model, _adamw(model.parameters()), zerocore.Config(bucket_bytes=256, **config))
        assert engine.device == device and engine.parts.comm.world_size == world
        out.append(_cpu(engine_train(engine, rank, world, STEPS, ACCUM, batch=_on(device, batch))))
        engine.close()
    return out


def _fp32_reference(world, model_fn=make, batch=lm_batch):
    device = _gpu()
    model = model_fn().to(device)
    return _cpu(reference_train(model, _adamw(model.parameters()), STEPS, ACCUM, world, batch=_on(device, batch)))


@pytest.mark.parametrize("world", [2, 4])
def test_every_stage_in_fp32_matches_torch(world, plane):
    configs = [dict(stage=s, **plane.config) for s in STAGES]
    ref = _fp32_reference(world)
    for rank, states in enumerate(run_ranks(_train, world, configs, timeout=TIMEOUT, start="spawn",
                                            group=plane.group)):
        for config, state in zip(configs, states):
            assert_state_close(state, ref, rtol=1e-5, atol=1e-6, what=f"rank {rank} of {world}, {config}")


# The CPU suite's bounds (test_mixed_precision.py): a share of each param's movement.
@pytest.mark.parametrize("dtype,config,bound", [
    ("bf16", {"reduce_dtype": "fp32"}, 1e-4),
    ("fp16", {"loss_scale": zerocore.DynamicLossScale(initial=2.0**10, window=2)}, 5e-3),
])
def test_16_bit_matches_mixed_precision_torch(dtype, config, bound, plane):
    world = 2
    device = _gpu()
    model = make().to(device)
    initial = _cpu(model.state_dict())
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2) if dtype == "fp16" else None
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    ref, _ = mp_reference_train(model, _adamw(model.parameters()), torch_dtype, STEPS, ACCUM, world, scaler=scaler,
                                batch=_on(device))
    configs = [dict(stage=s, dtype=dtype, **config, **plane.config) for s in STAGES]
    for rank, states in enumerate(run_ranks(_train, world, configs, timeout=TIMEOUT, start="spawn",
                                            group=plane.group)):
        for c, state in zip(configs, states):
            assert_moved_like(state, _cpu(ref), initial, bound, what=f"rank {rank}, stage {c['stage']} {dtype}")


def test_offload_matches_torch(plane):
    configs = [dict(stage=s, offload_optimizer="cpu", **plane.config) for s in (1, 2, 3)] + \
        [dict(stage=3, offload_optimizer="cpu", offload_params="cpu", **plane.config)]
    ref = _fp32_reference(2)
    for rank, states in enumerate(run_ranks(_train, 2, configs, timeout=TIMEOUT, start="spawn", group=plane.group)):
        for config, state in zip(configs, states):
            assert_state_close(state, ref, rtol=1e-5, atol=1e-6, what=f"rank {rank}, {config}")


CLIP = test_grad_scale.MAX_NORM  # the first steps' grad norms exceed it, the later ones' do not


def _clipped(rank, world, configs):
    """SGD (each param moves by its grad, so a clipping coefficient lost or
    added shows) with accumulation, at each Config; the full states."""
    device = _gpu()
    out = []
    for config in configs:
        model = make().to(device)
        engine = zerocore.wrap(model, test_grad_scale.sgd(model.parameters()),
                               zerocore.Config(bucket_bytes=256, **config))
        out.append(_cpu(engine_train(engine, rank, world, test_grad_scale.STEPS, ACCUM, batch=_on(device))))
        engine.close()
    return out


def test_accumulation_and_clipping_match_torch(plane):
    configs = [dict(stage=s, max_grad_norm=CLIP, **plane.config) for s in STAGES]
    # test_grad_scale.py's reference: torch's clip_grad_norm_ between backward and the step, on the host.
    ref, initial, _, _ = test_grad_scale._reference(test_grad_scale.sgd, test_grad_scale.STEPS, ACCUM, 2, clip=CLIP)
    for rank, states in enumerate(run_ranks(_clipped, 2, configs, timeout=TIMEOUT, start="spawn", group=plane.group)):
        for config, state in zip(configs, states):
            assert_moved_like(state, ref, initial, test_grad_scale.BOUND, what=f"rank {rank}, {config}")


def _checkpointed_blocks(rank, world):
    """test_activation_checkpoint.py's tensor-parallel GPT on cuda:0 over the
    ranks' group, without checkpointing and with zerocore.checkpoint (Pa,
    and Pa+cpu): each one's grads after two backwards, and the RNG's next
    draw (dropout replayed in the recomputation)."""
    device = _gpu()
    group = torch.distributed.group.WORLD
    out = {}
    for mode, offload in (("none", None), ("zerocore", None), ("zerocore", "cpu")):
        model = test_activation_checkpoint._model(group, mode, offload).to(device)
        for step in range(2):
            x, y = (t.to(device) for t in lm_batch(step, 0, 1))
            model(x, y)["loss"].backward()
        out[(mode, offload)] = ({n: p.grad.cpu() for n, p in model.named_parameters()},
                                torch.rand(4, device=device).cpu())
    return out


def test_partitioned_activation_checkpoints_match_no_checkpointing(plane):
    for rank, out in enumerate(run_ranks(_checkpointed_blocks, 2, timeout=TIMEOUT, start="spawn", group=plane.group)):
        grads, rng = out[("none", None)]
        for variant in (("zerocore", None), ("zerocore", "cpu")):
            got, got_rng = out[variant]
            for name in grads:
                torch.testing.assert_close(got[name], grads[name], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {rank} {variant} {name}: {m}")
            assert torch.equal(got_rng, rng), f"rank {rank} {variant}: the RNG after backward differs"


def _routed_train(rank, world, plane_config):
    """Stages 2 and 3 of the mixture-of-experts model whose ranks run
    different experts (test_divergent_units.py's): the lend path and
    divergent units on the GPU."""
    return _train(rank, world, [dict(stage=2, **plane_config), dict(stage=3, **plane_config)],
                  functools.partial(make, DataRouted), routed(random_codes))


def test_ranks_running_different_experts_match_torch(plane):
    results = run_ranks(_routed_train, 2, plane.config, timeout=TIMEOUT, start="spawn", group=plane.group)
    model_fn, batch = functools.partial(make, DataRouted), routed(random_codes)
    device = _gpu()
    initial = model_fn().state_dict()
    refs = []
    for dtype in (torch.float64, torch.float32):
        model = model_fn().to(device, dtype)
        refs.append(_cpu(reference_train(model, _adamw(model.parameters()), STEPS, ACCUM, 2, batch=_on(device, batch))))
    for rank, (stage2, stage3) in enumerate(results):
        for stage, state in ((2, stage2), (3, stage3)):
            assert_as_close_as_torch(state, *refs, initial, what=f"stage {stage} rank {rank}")


def _checkpointed(rank, world, path, save, plane_config):
    """Trains steps 0-1 and saves (save=True), or loads a fresh engine of
    other initial values; then trains steps 2-3. The global batches are the
    same at any world size."""
    device = _gpu()
    model = make(seed=0 if save else 1).to(device)
    config = zerocore.Config(stage=3, bucket_bytes=256, **plane_config)
    engine = zerocore.wrap(model, _adamw(model.parameters()), config)

    def steps(which):
        for step in which:
            for micro in range(ACCUM):
                x, y = (t.to(device) for t in lm_batch(step, micro, 4))
                engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
            engine.step()
            engine.zero_grad()

    if save:
        steps(range(2))
        engine.save(path)
    else:
        engine.load(path)
    steps(range(2, 4))
    return _cpu(engine.full_state_dict())


@pytest.mark.parametrize("resumed", [1, 4])
def test_a_checkpoint_saved_at_2_ranks_resumes_at_another_world_size(resumed, tmp_path, plane):
    path = str(tmp_path / "ckpt")
    straight = run_ranks(_checkpointed, 2, path, True, plane.config, timeout=TIMEOUT, start="spawn",
                         group=plane.group)[0]
    for rank, state in enumerate(run_ranks(_checkpointed, resumed, path, False, plane.config, timeout=TIMEOUT,
                                           start="spawn", group=plane.group)):
        assert_state_close(state, straight, rtol=1e-5, atol=1e-6, what=f"2 -> {resumed} ranks, rank {rank}")


def _dead_peer(rank, world, plane_config):
    """Rank 1 leaves after the first step; rank 0's next step must fail at
    once with an error, not wait out the timeout."""
    import time

    device = _gpu()
    model = make().to(device)
    engine = zerocore.wrap(model, _adamw(model.parameters()), zerocore.Config(stage=3, timeout=120, **plane_config))

    def step(s):
        x, y = (t.to(device) for t in lm_batch(s, 0, world))
        engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
        engine.step()

    step(0)
    if rank == 1:
        return None
    start = time.monotonic()
    try:
        step(1)
    except Exception as e:  # noqa: BLE001 - reported
        return type(e).__name__, str(e), time.monotonic() - start
    return None


def test_a_dead_peer_fails_the_others_at_once(plane):
    result = run_ranks(_dead_peer, 2, plane.config, timeout=TIMEOUT, start="spawn", group=plane.group)[0]
    assert result is not None, "rank 0 trained on without its peer"
    kind, message, seconds = result
    assert seconds < 30 and "timed out" not in message, (kind, message, seconds)


def _alone_in_full_state_dict(rank, world, plane_config):
    # A timeout past CUDA's and NCCL's start-up on a shared GPU: the error must come long before it.
    return test_rank_disagreement_device.scenario(rank, world, 3, "full_state_dict", _gpu(),
                                                  {"timeout": 120, **plane_config})


def test_a_rank_alone_in_full_state_dict_is_named_on_every_rank(plane):
    """With the data plane's collectives on the device: RankDisagreementError
    on every rank within diagnose_after and seconds, not NCCL's timeout."""
    test_rank_disagreement_device.check_apart(
        run_ranks(_alone_in_full_state_dict, 2, plane.config, timeout=TIMEOUT, start="spawn", group=plane.group),
        "full_state_dict")


def _snapshot_folders(rank, world, plane_config, folder):
    """STEPS steps at stage 3 with a snapshot each, each rank a node of its
    own (a mirror sent each step): (the mirrors' transport, {file name:
    bytes} of this rank's snapshot folder, the device bytes memory_report
    gives the snapshots)."""
    device = _gpu()
    model = make().to(device)
    engine = zerocore.wrap(model, _adamw(model.parameters()), zerocore.Config(
        stage=3, snapshot="memory", snapshot_run_id="gpu", snapshot_dir=folder.format(rank=rank), **plane_config))
    engine_train(engine, rank, world, STEPS, ACCUM, batch=_on(device))
    engine.snapshots.wait()
    held = engine.snapshots.dir
    files = {}
    for name in os.listdir(held):
        with open(os.path.join(held, name), "rb") as f:
            files[name] = f.read()
    transport = type(engine.parts.snapshot_transport).__name__
    device_bytes = engine.memory_report()["by_device"]["device"]["snapshots"]
    engine.close()
    return transport, files, device_bytes


def test_snapshot_mirrors_travel_over_the_data_plane(tmp_path, plane):
    """A GPU engine's mirrors: staged through device chunks over an NCCL
    group of their own where the data plane is NCCL, over sockets on a gloo
    data plane; each rank's mirror of its peer's snapshot is the peer's own
    file, byte for byte, for each of the two steps kept; the staged
    transport's four chunk buffers are in the memory report."""
    results = run_ranks(_snapshot_folders, 2, plane.config, str(tmp_path / "node-{rank}"), timeout=TIMEOUT,
                        start="spawn", group=plane.group)
    for rank, (transport, files, device_bytes) in enumerate(results):
        assert transport == ("SocketTransport" if plane.name == "gloo" else "StagedTransport")
        assert device_bytes == (0 if plane.name == "gloo" else 4 * snapshot_transport.CHUNK_BYTES)
        peer_files = results[1 - rank][1]
        mirrors = [name for name in files if f"rank-{1 - rank:05d}-of" in name]
        assert len(mirrors) == 2 and len(peer_files) == 4, (sorted(files), sorted(peer_files))
        for name in mirrors:
            assert files[name] == peer_files[name], f"rank {rank}'s mirror {name} differs from rank {1 - rank}'s file"


def test_the_staged_chunk_loop_on_the_gpu(plane):
    """The mirrors' staged loop itself (test_snapshots' ring of 3 ranks,
    sizes of many chunks, a few and none) with its buffers on the GPU,
    over the NCCL data plane (gloo cannot send a CUDA tensor)."""
    if plane.name == "gloo":
        pytest.skip("gloo has no send or recv of CUDA tensors; its mirrors go host to host")
    test_snapshots.assert_moved_around_the_ring(run_ranks, dict(timeout=TIMEOUT, start="spawn", group=plane.group),
                                                "cuda:0")
