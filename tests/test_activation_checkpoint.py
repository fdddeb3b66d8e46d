"""zerocore.checkpoint (ZeRO-R's partitioned activation checkpoints) on the
tensor-parallel GPT of zerocore/examples/tp_gpt.py: the grads and the RNG
afterwards equal torch.utils.checkpoint's and no checkpointing's at MP 2 and
4, with and without offload and contiguous buffers, with dropout inside the
checkpointed blocks; what autograd keeps per rank, measured with
saved-tensor hooks, is 1/MP of what torch's checkpoint keeps (plus
padding); the contiguous buffer is allocated once and reused; the next
checkpoint's gather is in flight while one recomputes; TP x ZeRO-DP trains
as without checkpointing, and as single-process torch, at every stage; bad
input gets a clear error. The slices are a backend's memory: on a checking
backend given as backend= every variant, on 1 and 2 ranks, runs with no
violation, no host wait and the grads of no checkpointing (a missing wait
would read its late copies' NaN), a read of offloaded slices before their
copy is named with the copy, the backend holds buffer_bytes() after the
first step and nothing once free_buffers() gave them back, a device
buffer copied back into is packed into again only after that copy, and
ranks forked from a process that offloaded on its backend still offload.
"""
import gc

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint
from torch.autograd.graph import saved_tensors_hooks

import zerocore
from zerocore import _native
from zerocore.zero_r import buffers as checkpoint_buffers
from dist_harness import RankError, run_ranks
from models import VOCAB, lm_batch
from zerocore.examples.gpt import GPTConfig
from zerocore.examples.tp_gpt import TPGPT, tp_groups

CFG = dict(vocab=VOCAB, n_layer=2, n_head=4, d_model=16, seq_len=8)
VARIANTS = [(offload, contiguous) for offload in (None, "cpu") for contiguous in (True, False)]
ALIGN = checkpoint_buffers.ALIGN


def _model(group, checkpointing, offload=None, contiguous=True):
    torch.manual_seed(0)  # every rank alike: the replicated dropout must agree across the group
    return TPGPT(GPTConfig(**CFG), group, checkpointing=checkpointing, offload=offload, contiguous=contiguous,
                 dropout=0.1)


def _grads_and_rng(model, steps=2):
    """Grads accumulated over `steps` forward-backward passes (the second
    reuses the contiguous buffer), and the RNG's next draw after them."""
    for step in range(steps):
        x, y = lm_batch(step, 0, 1)
        model(x, y)["loss"].backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, torch.rand(4)


def _saved_bytes(model, x, block_call) -> int:
    """Bytes autograd keeps for backward through the blocks, as saved-tensor
    hooks see them."""
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    h = model.tok_emb(x).detach().requires_grad_()
    with saved_tensors_hooks(pack, lambda t: t):
        for block in model.blocks:
            h = block_call(block, h)
    return sum(sizes)


def _equivalence(rank, world):
    group = dist.group.WORLD
    out = {mode: _grads_and_rng(_model(group, mode)) for mode in ("none", "torch")}
    for offload, contiguous in VARIANTS:
        out[(offload, contiguous)] = _grads_and_rng(_model(group, "zerocore", offload, contiguous))
    model = _model(group, "zerocore")
    x, _ = lm_batch(0, 0, 1)
    out["bytes"] = {
        "torch": _saved_bytes(model, x, lambda b, h: torch_checkpoint.checkpoint(b, h, use_reentrant=True)),
        "zerocore": _saved_bytes(model, x, lambda b, h: zerocore.checkpoint(b, h, group=group)),
        "none": _saved_bytes(model, x, lambda b, h: b(h)),
    }
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_matches_torch_checkpoint_and_no_checkpointing(world):
    for rank, out in enumerate(run_ranks(_equivalence, world, timeout=120)):
        ref_grads, ref_rng = out["none"]
        for mode in ["torch", *VARIANTS]:
            grads, rng = out[mode]
            assert set(grads) == set(ref_grads)
            for name in ref_grads:
                torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"rank {rank} {mode} {name}: {m}")
            assert torch.equal(rng, ref_rng), f"rank {rank} {mode}: the RNG after backward differs"
        saved = out["bytes"]
        # Each of the 2 blocks keeps its input: torch whole, zerocore 1/MP of it, padded to ALIGN bytes.
        assert 0 <= saved["zerocore"] * world - saved["torch"] < world * ALIGN * CFG["n_layer"], saved
        assert saved["none"] > 4 * saved["torch"], saved  # checkpointing at all is what saves most


def _odd_sizes(rank, world):
    """Bytes kept for a checkpoint of a 37-element fp32 tensor, per rank."""
    sizes = []
    with saved_tensors_hooks(lambda t: sizes.append(t.numel() * t.element_size()) or t, lambda t: t):
        y = zerocore.checkpoint(lambda t: t * 2, torch.randn(37, requires_grad=True), group=dist.group.WORLD)
    y.sum().backward()
    return sizes


@pytest.mark.parametrize("world", [2, 4])
def test_slices_are_padded_to_split_evenly(world):
    per_rank = -(-37 // world) * 4
    for sizes in run_ranks(_odd_sizes, world):
        assert sizes == [-(-per_rank // ALIGN) * ALIGN]


def _buffer_reuse(rank, world):
    """Per step: the buffer's size and address, and whether every saved
    segment of the step lies inside it."""
    model = _model(dist.group.WORLD, "zerocore")
    steps = []
    for step in range(3):
        starts = []
        # The checkpoints' segments are the model's only uint8 tensors saved for backward.
        keep = lambda t: t.dtype == torch.uint8 and starts.append((t.data_ptr(), t.numel()))  # noqa: E731
        with saved_tensors_hooks(lambda t: keep(t) or t, lambda t: t):
            x, y = lm_batch(step, 0, 1)
            loss = model(x, y)["loss"]
        loss.backward()
        arena = checkpoint_buffers.homes[checkpoint_buffers.chosen[torch.device("cpu")]].arenas["device"]
        base, size = arena.buffer.data_ptr(), arena.buffer.numel()
        assert len(starts) == CFG["n_layer"]
        inside = all(base <= p and p + n <= base + size for p, n in starts)
        steps.append((size, base, inside, zerocore.activation_memory()))
    return steps


def test_contiguous_buffer_is_allocated_once_and_reused():
    for steps in run_ranks(_buffer_reuse, 2):
        (size, base, inside, memory), *later = steps
        assert not inside  # the first step measures, with allocations of its own
        assert size == memory["kept"] == memory["buffers"] > 0
        assert 2 * memory["kept"] == memory["unpartitioned"]
        for later_size, later_base, later_inside, _ in later:
            assert (later_size, later_base, later_inside) == (size, base, True)


def _prefetch_seen(rank, world, offload):
    """For each recomputation in backward, per live checkpoint: whether its
    gather was already issued, and whether its copy back to the device was."""
    seen = []

    def block(x):
        if torch.is_grad_enabled():  # the recomputation
            live = checkpoint_buffers.live
            seen.append([(s.pending is not None, s.landed is not None) for s in live])
        return torch.tanh(x) * 2

    h = torch.randn(4, 8, requires_grad=True)
    for _ in range(4):
        h = zerocore.checkpoint(block, h, group=dist.group.WORLD, offload=offload)
    h.sum().backward()
    return seen


def test_next_gather_is_in_flight_during_recomputation():
    for seen in run_ranks(_prefetch_seen, 2, None):
        # Recomputing checkpoint 4, then 3, 2, 1: the one before it is already being gathered,
        # and none further ahead.
        assert seen == [[(False, False), (False, False), (True, False), (True, False)],
                        [(False, False), (True, False), (True, False)], [(True, False), (True, False)],
                        [(True, False)]]


def test_offloaded_copy_back_runs_two_ahead():
    for seen in run_ranks(_prefetch_seen, 2, "cpu"):
        # The one before is being gathered, its copy back done; the one before that is being
        # copied back, not yet gathered; none further ahead.
        assert seen == [[(False, False), (False, True), (True, True), (True, True)],
                        [(False, True), (True, True), (True, True)], [(True, True), (True, True)],
                        [(True, True)]]


STAGES = (0, 1, 2, 3)


def _tp_dp_training(rank, world):
    tp_group, dp_group = tp_groups(2)
    dp_rank, dp_world = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    out = {}
    for stage in STAGES:
        for mode in ("none", "zerocore"):
            model = _model(tp_group, mode, offload="cpu" if stage % 2 else None)
            engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   zerocore.Config(stage=stage), group=dp_group)
            torch.manual_seed(1)  # the dropout masks from here on, as in _dense_reference
            reports = []
            for step in range(2):
                x, y = lm_batch(step, 0, dp_world)
                x, y = x.chunk(dp_world)[dp_rank], y.chunk(dp_world)[dp_rank]
                engine.backward(engine(x, y)["loss"])
                engine.step()
                engine.zero_grad()
                reports.append(engine.memory_report()["activations"])
            out[(stage, mode)] = (engine.full_state_dict(), reports)
    return out


def _dense_reference(steps=2, dp_world=2):
    """Single-process torch: the model at tensor-parallel degree 1 (the same
    blocks and dropout), AdamW on each step's global batch. Each data-parallel
    rank draws its dropout masks from the same RNG state (seeded alike), so
    each rank's slice runs from the step's starting state."""
    with torch.random.fork_rng():
        model = _model(None, "none")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(1)
        for step in range(steps):
            x, y = lm_batch(step, 0, dp_world)
            start, loss = torch.get_rng_state(), 0.0
            for r in range(dp_world):
                torch.set_rng_state(start)
                loss = loss + model(x.chunk(dp_world)[r], y.chunk(dp_world)[r])["loss"] / dp_world
            loss.backward()
            opt.step()
            opt.zero_grad()
    return model.state_dict()


def _unshard(states):
    """The dense params from the state dicts of a tensor-parallel group's
    ranks (in group order): column-parallel rows (of each of qkv's three
    matrices) and row-parallel columns put back together."""
    out = {}
    for name, t in states[0].items():
        shards = [s[name] for s in states]
        if ".qkv." in name or ".fc." in name:
            parts = 3 if ".qkv." in name else 1
            stacked = torch.cat([p.reshape(parts, -1, *p.shape[1:]) for p in shards], dim=1)
            out[name] = stacked.reshape(-1, *t.shape[1:])
        elif name.endswith("proj.weight"):
            out[name] = torch.cat(shards, dim=1)
        else:
            out[name] = t
    return out


def test_tensor_parallel_with_zero_dp_at_every_stage():
    outs = run_ranks(_tp_dp_training, 4, timeout=180)
    dense = _dense_reference()
    for rank, out in enumerate(outs):
        for stage in STAGES:
            ref, _ = out[(stage, "none")]
            got, reports = out[(stage, "zerocore")]
            for name in ref:
                torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"rank {rank} stage {stage} {name}: {m}")
            assert reports[0] == reports[1] > 0, reports  # sized on the first step, the same after
    # And both trained what single-process torch trains (measured within 7.2e-7; 2 steps move
    # params by up to 2e-3), each group's shards put together.
    for dp_rank, group in enumerate((outs[0:2], outs[2:4])):
        for stage in STAGES:
            for mode in ("none", "zerocore"):
                got = _unshard([out[(stage, mode)][0] for out in group])
                assert set(got) == set(dense)
                for name in dense:
                    torch.testing.assert_close(got[name], dense[name], rtol=1e-5, atol=3e-6,
                                               msg=lambda m: f"DP rank {dp_rank} stage {stage} {mode} {name}: {m}")


def _not_in_group(rank, world):
    group = dist.new_group([0])  # every rank makes it; rank 1 is not in it
    # Both ranks connected before rank 1 fails and exits: else rank 0 may still
    # be meeting it (gloo's connectFullMesh: "Connection closed by peer").
    dist.barrier()
    if rank == 1:
        zerocore.checkpoint(torch.tanh, torch.randn(3, requires_grad=True), group=group)
    return True


def test_group_the_rank_is_not_in():
    results = run_ranks(_not_in_group, 2, raise_errors=False)
    assert results[0] is True
    assert isinstance(results[1], RankError) and "zerocore.checkpoint: this rank (global rank 1) is not in " \
        "the group (ranks [0])" in results[1].message


class Holder:
    def __init__(self, t):
        self.t = t


def test_bad_input_is_named():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match=r"zerocore.checkpoint: fn returned a Holder holding tensors"):
        zerocore.checkpoint(lambda t: Holder(t * 2), x)
    with pytest.raises(ValueError, match=r"zerocore.checkpoint: use_reentrant=True is not supported"):
        zerocore.checkpoint(torch.tanh, x, use_reentrant=True)
    with pytest.raises(ValueError, match=r"zerocore.checkpoint: offload must be None or \"cpu\""):
        zerocore.checkpoint(torch.tanh, x, offload="gpu")
    with pytest.raises(RuntimeError, match=r"zerocore.checkpoint: group= needs torch.distributed"):
        zerocore.checkpoint(torch.tanh, x, group=object())
    with pytest.raises(ValueError, match=r"zerocore.checkpoint: fn's tensor arguments are on cpu: backend= must be "
                                         r"a backend of that device .*, got object"):
        zerocore.checkpoint(torch.tanh, x, backend=object())
    assert not checkpoint_buffers.live  # a failed call keeps nothing


def test_outputs_of_any_structure_and_non_tensor_inputs():
    lin = torch.nn.Linear(4, 4).double()
    x = torch.randn(2, 4, dtype=torch.double)  # requires no grad: the params still get theirs

    def fn(a, scale, *, shift):
        y = lin(a) * scale + shift
        return {"y": y, "n": a.shape[0], "pair": (y.sum(), "tag")}

    out = zerocore.checkpoint(fn, x, 3.0, shift=1.0)
    assert out["n"] == 2 and out["pair"][1] == "tag"
    (out["y"].square().sum() + out["pair"][0]).backward()
    got = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad()
    ref = fn(x, 3.0, shift=1.0)
    (ref["y"].square().sum() + ref["pair"][0]).backward()
    for g, r in zip(got, lin.parameters()):
        torch.testing.assert_close(g, r.grad, rtol=0, atol=0)


# The slices on a backend's memory ----------------------------------------------------------------
NO_BYTES = {"host_pageable": 0, "host_pinned": 0, "device": 0}


def _checked_variants(rank, world, seed):
    """Per variant, on a checking backend of this rank's given as backend=:
    grads through 5 checkpointed blocks over 2 steps (offloaded, a block's
    backward reuses the device buffer of one 3 blocks later; the second step
    reuses the contiguous buffers) and without checkpointing; the checker's
    violations and host waits."""
    group = dist.group.WORLD if world > 1 else None
    out = {}
    for offload, contiguous in VARIANTS:
        # Late completion of up to 2 ms on the copy stream: a read it is not waited for sees NaN.
        backend = _native.CheckingBackend(seed=seed + rank, max_delay_us=2000, throw_on_violation=False)
        torch.manual_seed(seed)  # every rank alike, as a model-parallel group computes the same inputs
        layers = [torch.nn.Linear(6, 6).double() for _ in range(5)]
        x = torch.randn(5, 6, dtype=torch.double, requires_grad=True)
        grads = {}
        for mode in ("zerocore", "none"):
            for step in range(2):
                h = x * (step + 1)
                for lin in layers:
                    block = lambda t, lin=lin: torch.tanh(lin(t))  # noqa: E731
                    h = zerocore.checkpoint(block, h, group=group, offload=offload, contiguous=contiguous,
                                            backend=backend) if mode == "zerocore" else block(h)
                h.square().sum().backward()
            grads[mode] = [t.grad.clone() for t in (x, *[p for lin in layers for p in lin.parameters()])]
            for t in (x, *[p for lin in layers for p in lin.parameters()]):
                t.grad = None
        out[(offload, contiguous)] = (grads, backend.violations(), backend.take_host_waits())
        checkpoint_buffers.free_buffers()  # forgets the backend
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_every_access_is_ordered_on_the_checking_backend(world, zerocore_seed):
    for rank, out in enumerate(run_ranks(_checked_variants, world, zerocore_seed, timeout=120)):
        for variant, (grads, violations, host_waits) in out.items():
            what = f"rank {rank} of {world}, offload, contiguous = {variant}"
            assert violations == [], f"{what}: {violations}"
            assert host_waits == 0, f"{what}: the host waited {host_waits} times; only streams wait"
            for got, ref in zip(grads["zerocore"], grads["none"]):
                torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def test_reading_offloaded_slices_before_their_copy_is_named(gen):
    """The test reads the offloaded slices on the compute stream right
    after the checkpoint, waiting for nothing: the checker names the copy
    it did not wait for, and the read sees the fresh buffer's NaN, not the
    slices. The checkpoint's own accesses then wait as they must."""
    # Each copy starts 250 ms late: long enough that the test's read comes first even on a busy machine.
    backend = _native.CheckingBackend(seed=int(torch.randint(2**31, (), generator=gen)), min_delay_us=250000,
                                      max_delay_us=250000, throw_on_violation=False)
    x = torch.randn(64, generator=gen, requires_grad=True)
    saved = []
    with saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = zerocore.checkpoint(torch.tanh, x, offload="cpu", backend=backend)
    (segment,) = [t for t in saved if t.dtype == torch.uint8]
    backend.declare_access(backend.compute_stream(), segment.view(torch.float32), "read", "the test reads")
    assert torch.isnan(segment.view(torch.float32)).all()
    (violation,) = backend.violations()
    assert "unordered accesses to buffer 'slices of checkpoint " in violation and "(host pinned)" in violation
    assert "'copy' on stream 'activation offload' writes bytes [0, 256)" in violation
    assert "'the test reads' on stream 'compute' reads bytes [0, 256)" in violation
    y.sum().backward()
    assert len(backend.violations()) == 1
    ref = x.detach().clone().requires_grad_()
    torch.tanh(ref).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=0, atol=0)
    checkpoint_buffers.free_buffers()


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_buffers_are_the_backends(offload, gen):
    """What the backend given holds, by kind: the separate slices during the
    first step, the contiguous buffer from its end on, and offloaded, the
    device buffers offload works in (one the forward packs each checkpoint
    in, then the 3 backward copies them back to: it recomputes one, gathers
    the next, copies back the one after), all of it buffer_bytes(); nothing
    more during the second step, and nothing once given back."""
    backend = _native.CpuBackend()
    kind = "host_pinned" if offload else "device"
    x = torch.randn(7, 3, generator=gen, requires_grad=True)
    per_checkpoint = -(-x.numel() * 4 // ALIGN) * ALIGN
    before = checkpoint_buffers.buffer_bytes()
    held = []
    for step in range(2):
        h = x
        for _ in range(3):
            h = zerocore.checkpoint(torch.tanh, h, offload=offload, backend=backend)
        held.append(backend.allocated_bytes())
        h.sum().backward()
        held.append(backend.allocated_bytes())
    total = 3 * per_checkpoint
    first_forward = {**NO_BYTES, kind: total, **({"device": per_checkpoint} if offload else {})}
    after = {**NO_BYTES, kind: total, "device": total}
    assert held == [first_forward, after, after, after], held
    assert checkpoint_buffers.buffer_bytes() - before == sum(after.values())
    checkpoint_buffers.free_buffers()
    assert backend.allocated_bytes() == NO_BYTES
    assert checkpoint_buffers.buffer_bytes() == 0


def test_offload_device_buffers_are_reused(gen):
    """Offloaded, the forward packs each checkpoint in a device buffer and
    backward copies each back to one, kept for later use: as many as are
    used at once (3, in backward through a chain of 5), each replaced by a
    larger one when the inputs grow, reused when they shrink."""
    backend = _native.CpuBackend()
    held = []
    for rows in (4, 9, 2, 9):
        h = torch.randn(rows, 3, generator=gen, requires_grad=True)
        for _ in range(5):
            h = zerocore.checkpoint(torch.tanh, h, offload="cpu", contiguous=False, backend=backend)
        h.sum().backward()
        held.append(backend.allocated_bytes()["device"])
    per_checkpoint = [-(-rows * 3 * 4 // ALIGN) * ALIGN for rows in (4, 9)]
    assert held == [3 * per_checkpoint[0]] + [3 * per_checkpoint[1]] * 3, held
    assert checkpoint_buffers.buffer_bytes(offloaded=False) >= held[-1]
    checkpoint_buffers.free_buffers()
    assert backend.allocated_bytes() == NO_BYTES


def _offloaded_grad(rank, world, seed):
    torch.manual_seed(seed)  # every rank alike
    x = torch.randn(5, 3, dtype=torch.double, requires_grad=True)
    zerocore.checkpoint(torch.tanh, x, group=dist.group.WORLD, offload="cpu").square().sum().backward()
    return x.detach(), x.grad


def test_forked_ranks_copy_on_streams_of_their_own(zerocore_seed):
    """This process offloads on its backend first, which starts the copy
    stream's thread here; ranks forked from it inherit the stream but not
    the thread, and still offload (on streams of their own)."""
    x = torch.randn(5, 3, requires_grad=True)
    zerocore.checkpoint(torch.tanh, x, offload="cpu").sum().backward()
    checkpoint_buffers.free_buffers()  # the ranks inherit no buffers, only the stream
    for x, grad in run_ranks(_offloaded_grad, 2, zerocore_seed, timeout=60):
        torch.testing.assert_close(grad, 2 * torch.tanh(x) * (1 - torch.tanh(x) ** 2), rtol=1e-12, atol=0)


def test_a_device_buffer_copied_back_into_is_reused_after_the_copy(gen):
    """A checkpoint copied back ahead of need whose graph is then dropped
    (backward of a later graph reached past it) gives its device buffer
    back with the copy as its last use: the forward that packs into that
    buffer next waits for the copy, not only for the compute stream."""
    backend = _native.CheckingBackend(seed=int(torch.randint(2**31, (), generator=gen)), max_delay_us=2000)
    small = torch.randn(8, generator=gen, requires_grad=True)
    # Graph A: a1 keeps 8 floats, a2 the 32 a1 made; graph B: b1, made last, keeps 32.
    a1 = zerocore.checkpoint(lambda t: t.repeat(4), small, offload="cpu", backend=backend)
    a2 = zerocore.checkpoint(torch.tanh, a1, offload="cpu", backend=backend)
    del a1
    b1 = zerocore.checkpoint(torch.tanh, torch.randn(32, generator=gen, requires_grad=True), offload="cpu",
                             backend=backend)
    b1.sum().backward()  # prefetches a2 and copies a1 back, the checkpoints made before it
    del a2
    gc.collect()  # graph A dropped: a1's device buffer goes back with its copy back in flight
    assert not checkpoint_buffers.live
    # The smallest spare that fits 8 floats is a1's: packing into it must wait for that copy.
    y = zerocore.checkpoint(torch.tanh, small, offload="cpu", backend=backend)
    y.sum().backward()
    assert backend.violations() == []
    # Against the same function's grad without a checkpoint, bit for bit: a stale or NaN-poisoned read
    # differs; a closed form (1 - tanh^2) need not match autograd's float32 rounding.
    reference = small.detach().clone().requires_grad_(True)
    torch.tanh(reference).sum().backward()
    assert torch.equal(small.grad, reference.grad)
    checkpoint_buffers.free_buffers()
