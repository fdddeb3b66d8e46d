"""zerocore.checkpoint (ZeRO-R's partitioned activation checkpoints) on the
tensor-parallel GPT of zerocore/examples/tp_gpt.py: the grads and the RNG
afterwards equal torch.utils.checkpoint's and no checkpointing's at MP 2 and
4, with and without offload and contiguous buffers, with dropout inside the
checkpointed blocks; what autograd keeps per rank, measured with
saved-tensor hooks, is 1/MP of what torch's checkpoint keeps (plus
padding); the contiguous buffer is allocated once and reused; the next
checkpoint's gather is in flight while one recomputes; TP x ZeRO-DP trains
as without checkpointing, and as single-process torch, at every stage; bad
input gets a clear error.
"""
import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint
from torch.autograd.graph import saved_tensors_hooks

import zerocore
from zerocore import activation_checkpoint
from dist_harness import RankError, run_ranks
from models import VOCAB, lm_batch
from zerocore.examples.gpt import GPTConfig
from zerocore.examples.tp_gpt import TPGPT, tp_groups

CFG = dict(vocab=VOCAB, n_layer=2, n_head=4, d_model=16, seq_len=8)
VARIANTS = [(offload, contiguous) for offload in (None, "cpu") for contiguous in (True, False)]
ALIGN = activation_checkpoint._ALIGN


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
        (arena,) = activation_checkpoint._arenas.values()
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


def _prefetch_seen(rank, world):
    """For each recomputation in backward, whether the gather of the
    checkpoint backward reaches next was already issued."""
    seen = []

    def block(x):
        if torch.is_grad_enabled():  # the recomputation
            live = activation_checkpoint._live
            seen.append([s.pending is not None for s in live])
        return torch.tanh(x) * 2

    h = torch.randn(4, 8, requires_grad=True)
    for _ in range(3):
        h = zerocore.checkpoint(block, h, group=dist.group.WORLD)
    h.sum().backward()
    return seen


def test_next_gather_is_in_flight_during_recomputation():
    for seen in run_ranks(_prefetch_seen, 2):
        # Recomputing checkpoint 3, then 2, then 1: the one before it is already being gathered,
        # and none further ahead.
        assert seen == [[False, True, True], [True, True], [True]]


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
    assert not activation_checkpoint._live  # a failed call keeps nothing


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
