"""Large-model initialisation: a model built on the meta device
(zerocore.init()) gets its values at wrap, each rank only the part it holds,
bit for bit what eager construction after the same seed gives (the RNG
after wrap too), or model.apply(fn), or loading a state_dict or a
safetensors file into a plain model; engine.load_state_dict loads the same
into a wrapped engine. Ranks that would initialise differently, and sources
that do not fit, fail on every rank with nothing changed; and a model
bigger than a rank's memory cap wraps under the cap."""
import ctypes
import resource

import pytest
import torch
from torch import nn

import zerocore
from dist_harness import RankError, run_ranks
from models import DIM, TinyLM, lm_batch, lm_loss, local, make
from zerocore.io import safetensors_file

SEED = 5
STEPS = 3
TINY = 256  # bytes per bucket: params straddle buckets and ranks
HP = dict(lr=1e-3, weight_decay=0.1)


def _meta_lm(seed=SEED):
    torch.manual_seed(seed)
    with zerocore.init():
        return TinyLM()


def _wrap(model, stage, dtype="fp32", **kw):
    return zerocore.wrap(model, torch.optim.AdamW(model.parameters(), **HP),
                         zerocore.Config(stage=stage, dtype=dtype, bucket_bytes=TINY), **kw)


def _train(engine, rank, world, steps=STEPS) -> list:
    """The loss of each step on this rank's part of the global batch."""
    losses = []
    for step in range(steps):
        x, y = lm_batch(step, 0, world)
        loss = lm_loss(engine(local(x, rank, world)), local(y, rank, world))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


def _live(engine) -> dict:
    """The params as the module computes with them (training dtype)."""
    with engine.gathered_params() as module:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_equal(got, ref, what):
    assert set(got) == set(ref), f"{what}: keys differ: {set(got) ^ set(ref)}"
    for k in ref:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), f"{what}: {k} differs"


def _eager(seed=SEED):
    """Eager construction's state_dict, and the RNG's next draws after it."""
    model = make(seed=seed)
    return model.state_dict(), torch.rand(4)


# Initialised by reset_parameters, as eager construction does ---------------

def _meta_and_eager(rank, world, stage):
    out = {}
    for dtype in ("fp32", "bf16"):
        engine = _wrap(_meta_lm(), stage, dtype)
        res = out[dtype] = {"rng": torch.rand(4)}
        res["values"], res["live"] = engine.full_state_dict(), _live(engine)
        res["losses"] = _train(engine, rank, world)
        res["eager_losses"] = _train(_wrap(make(seed=SEED), stage, dtype), rank, world)
    return out


@pytest.mark.parametrize("stage,world", [(0, 2), (1, 2), (2, 2), (3, 2), (3, 4)])
def test_meta_init_equals_eager_init(stage, world):
    ref, rng = _eager()
    for rank, res in enumerate(run_ranks(_meta_and_eager, world, stage)):
        for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            r, what = res[dtype], f"rank {rank} stage {stage} {dtype}"
            _assert_equal(r["values"], ref, f"{what} fp32 values")  # the masters hold eager's values
            _assert_equal(r["live"], {k: v.to(torch_dtype) for k, v in ref.items()}, f"{what} params")
            assert torch.equal(r["rng"], rng), f"{what}: the RNG after wrap is not where eager construction leaves it"
            assert r["losses"] == r["eager_losses"], what


class _Normed(nn.Module):
    """Buffers on the meta device (BatchNorm's running statistics), which
    reset_parameters sets too."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.bn = nn.BatchNorm1d(DIM)


def test_meta_buffers_are_initialised_too():
    torch.manual_seed(SEED)
    eager = _Normed()
    torch.manual_seed(SEED)
    with zerocore.init():
        model = _Normed()
    engine = zerocore.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), {"stage": 0})
    _assert_equal(engine.full_state_dict(), eager.state_dict(), "meta _Normed")


# Initialised by a function, as model.apply(fn) does -----------------------

def _init_weights(module):
    """An init function in the style of transformers' _init_weights: each
    kind of module its own distribution, so a value drawn by the wrong
    module or in the wrong order shows."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.uniform_(module.bias, -0.1, 0.1)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=1.0)
    elif isinstance(module, nn.LayerNorm):
        nn.init.normal_(module.weight, 1.0, 0.1)
        nn.init.zeros_(module.bias)


def _materialised(model):
    """A meta TinyLM on the CPU, uninitialised, its tie kept (to_empty unties it)."""
    model.to_empty(device="cpu")
    model.head.weight = model.embed.weight
    return model


def _init_fn(rank, world, stage):
    engine = _wrap(_meta_lm(), stage, init=_init_weights)
    return torch.rand(4), engine.full_state_dict()


@pytest.mark.parametrize("stage", [1, 3])
def test_init_fn_equals_apply_on_a_materialised_model(stage):
    model = _materialised(_meta_lm())
    model.apply(_init_weights)  # the tied weight keeps the head's values: it is applied last
    ref, rng = model.state_dict(), torch.rand(4)
    for rank, (rank_rng, values) in enumerate(run_ranks(_init_fn, 2, stage)):
        _assert_equal(values, ref, f"rank {rank}")
        assert torch.equal(rank_rng, rng), f"rank {rank}: the RNG after wrap is not where model.apply leaves it"


# Errors ---------------------------------------------------------------------


def _init_failing_on_rank_1(rank, world):
    def init(module):
        if rank == 1 and isinstance(module, nn.Linear):
            raise RuntimeError("the user's init failed")
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()

    _wrap(_meta_lm(), 3, init=init)


def test_an_init_function_failing_on_one_rank_fails_every_rank():
    results = run_ranks(_init_failing_on_rank_1, 2, raise_errors=False, timeout=30)
    assert isinstance(results[1], RankError) and "the user's init failed" in results[1].message, results[1]
    assert isinstance(results[0], RankError) and "failed on rank(s) [1]" in results[0].message, results[0]

def _wrap_seeded_by_rank(rank, world):
    _wrap(_meta_lm(seed=SEED + rank), 3)


def test_ranks_with_different_seeds_fail_together():
    for r in run_ranks(_wrap_seeded_by_rank, 2, raise_errors=False, timeout=30):
        assert isinstance(r, RankError) and r.exc_type == "ValueError", r
        assert "random number generators of rank(s) [1] differ" in r.message and "torch.manual_seed" in r.message


class _Gate(nn.Module):
    """Params of its own and no reset_parameters: nothing says how to initialise them."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(DIM))


def _gated_lm():
    model = _meta_lm()
    with zerocore.init():
        model.blocks[1].gate = _Gate()
    return model


def test_a_module_without_reset_parameters_gets_an_error_that_says_what_to_do():
    model = _gated_lm()
    with pytest.raises(ValueError, match=r"zerocore.wrap: module\(s\) blocks.1.gate \(_Gate\) .* no "
                                         r"reset_parameters\(\).* init="):
        _wrap(model, 0)
    assert getattr(model, "_zerocore_engine", None) is None and model.blocks[1].gate.gain.is_meta

    def init(module):  # the fix the message names
        if isinstance(module, _Gate):
            nn.init.normal_(module.gain)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()

    engine = _wrap(model, 0, init=init)
    _assert_equal(engine.full_state_dict(), _materialised(_gated_lm()).apply(init).state_dict(), "init= fixes it")


def _gated_on_every_rank(rank, world):
    _wrap(_gated_lm(), 3)


def test_a_module_without_reset_parameters_fails_every_rank():
    for r in run_ranks(_gated_on_every_rank, 2, raise_errors=False, timeout=30):
        assert isinstance(r, RankError) and "blocks.1.gate (_Gate)" in r.message, r


def _attention_layers():
    """torch's attention layers, whose nn.MultiheadAttention initialises in
    _reset_parameters (no reset_parameters) and zeroes its out_proj's bias."""
    return nn.Sequential(nn.TransformerEncoderLayer(DIM, 2, 2 * DIM),
                         nn.MultiheadAttention(DIM, 2, kdim=8, vdim=8, add_bias_kv=True))


def _meta_attention(rank, world, stage):
    torch.manual_seed(SEED)
    with zerocore.init():
        model = _attention_layers()
    engine = _wrap(model, stage)
    return engine.full_state_dict(), torch.rand(4)


@pytest.mark.parametrize("stage", [0, 3])
def test_meta_init_of_multihead_attention_equals_eager_init(stage):
    torch.manual_seed(SEED)
    ref = _attention_layers().state_dict()
    rng = torch.rand(4)
    for rank, (values, after) in enumerate(run_ranks(_meta_attention, 2, stage)):
        _assert_equal(values, ref, f"stage {stage} rank {rank}")
        assert torch.equal(after, rng), f"stage {stage} rank {rank}: the RNG after wrap is not eager's"


def test_bad_init_arguments():
    with pytest.raises(TypeError, match="zerocore.wrap: init= takes None"):
        _wrap(_meta_lm(), 0, init=42)
    with pytest.raises(ValueError, match="zerocore.wrap: init= is a function, but no parameter"):
        _wrap(make(), 0, init=_init_weights)

    def replace(module):
        if isinstance(module, nn.LayerNorm):
            module.weight = nn.Parameter(torch.ones(DIM))
        else:
            module.reset_parameters()

    with pytest.raises(ValueError, match=r"initialising blocks.0.norm \(LayerNorm\) replaced its parameter weight"):
        _wrap(_meta_lm(), 0, init=replace)


# Loading a state_dict or a safetensors file ----------------------------------

def _pretrained() -> dict:
    """A state_dict other than the one the seed gives (tied: embed.weight
    and head.weight are one tensor)."""
    return make(seed=7).state_dict()


def _save(state, path, drop=()):
    safetensors_file.write(path, [(k, v.dtype, v.shape, v) for k, v in state.items() if k not in drop])
    return path


def _from_sources(rank, world, stage, sources):
    out = {}
    for name, source in sources.items():
        # No RNG is involved: ranks seeded differently load the same values.
        engine = _wrap(_meta_lm(seed=rank), stage, init=source)
        out[name] = engine.full_state_dict(), _live(engine)
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_init_from_a_state_dict_or_a_safetensors_file(tmp_path, stage):
    ref = _pretrained()
    sources = {"state_dict": ref, "file": _save(ref, tmp_path / "m.safetensors"),
               "file with one name of the tied weight": _save(ref, tmp_path / "one.safetensors", drop={"head.weight"})}
    for rank, res in enumerate(run_ranks(_from_sources, 2, stage, sources)):
        for name, (values, live) in res.items():
            _assert_equal(values, ref, f"rank {rank} {name}")
            _assert_equal(live, ref, f"rank {rank} {name} params")


def test_init_from_a_source_that_does_not_fit():
    ref = _pretrained()
    missing = {k: v for k, v in ref.items() if k != "blocks.0.up.bias"}
    with pytest.raises(ValueError, match=r"zerocore.wrap: init= does not fit the model \(missing: blocks.0.up.bias\)"):
        _wrap(_meta_lm(), 0, init=missing)
    wrong = dict(ref, **{"norm.weight": torch.ones(DIM + 1), "extra": torch.ones(1)})
    with pytest.raises(ValueError, match=r"shapes differ: norm.weight \(\(17,\) in the source, \(16,\) in the model\); "
                                         r"unexpected: extra"):
        _wrap(_meta_lm(), 0, init=wrong)
    with pytest.raises(ValueError, match="zerocore.wrap: cannot read init=: .*no-such.safetensors"):
        _wrap(_meta_lm(), 0, init="no-such.safetensors")


def test_init_from_a_state_dict_sets_buffers():
    source = _Normed().state_dict()
    source["bn.running_mean"] = torch.randn(DIM)
    with zerocore.init():
        model = _Normed()
    engine = zerocore.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), {"stage": 0}, init=source)
    _assert_equal(engine.full_state_dict(), source, "buffers from init=")


def _optimizer_states(engine):
    """The moments (the fp32 masters are params, which a load sets)."""
    return [t.clone() for g in engine.groups for t in g.state.values()]


def _load_into_trained(rank, world, stage, dtype, path):
    ref = _pretrained()
    engine = _wrap(make(seed=SEED), stage, dtype)
    _train(engine, rank, world)  # optimizer states, and (stage 3) units gathered for the next forward
    out = {"states": _optimizer_states(engine)}
    out["before"] = before = engine.full_state_dict()
    bad = {"missing": {k: v for k, v in ref.items() if k != "norm.bias"},
           "shape": dict(ref, **{"norm.bias": torch.ones(2)}),
           "unexpected": dict(ref, extra=torch.ones(1)),
           "rank 1's": ref if rank == 0 else {}}
    out["errors"] = {}
    for name, source in bad.items():
        with pytest.raises(ValueError) as err:
            engine.load_state_dict(source)
        out["errors"][name] = str(err.value)
    _assert_equal(engine.full_state_dict(), before, "after the errors")
    out["keys"] = engine.load_state_dict(path)
    out["values"], out["live"] = engine.full_state_dict(), _live(engine)
    out["states_after"] = _optimizer_states(engine)
    out["loss"] = _train(engine, rank, world, steps=1)[0]
    out["partial"] = engine.load_state_dict({k: v for k, v in before.items() if k != "norm.bias"}, strict=False)
    out["after_partial"] = engine.full_state_dict()
    return out


@pytest.mark.parametrize("stage,dtype", [(1, "bf16"), (3, "fp32"), (3, "bf16")])
def test_engine_load_state_dict(tmp_path, stage, dtype):
    ref = _pretrained()
    path = _save(ref, tmp_path / "m.safetensors")
    plain = TinyLM()
    plain.load_state_dict(ref)
    x, y = lm_batch(0, 0, 2)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    for rank, r in enumerate(run_ranks(_load_into_trained, 2, stage, dtype, path)):
        what = f"rank {rank} stage {stage} {dtype}"
        errors = r["errors"]
        assert errors["missing"].startswith("engine.load_state_dict: the source does not fit the model (missing: "
                                            "norm.bias)"), errors["missing"]
        assert "shapes differ: norm.bias ((2,) in the source, (16,) in the model)" in errors["shape"]
        assert "unexpected: extra" in errors["unexpected"]
        assert ("rank(s) [1]" if rank == 0 else "missing: embed.weight") in errors["rank 1's"]
        assert tuple(r["keys"]) == ([], [])
        _assert_equal(r["values"], ref, f"{what} loaded")  # the fp32 masters: the source's values exactly
        _assert_equal(r["live"], {k: v.to(torch_dtype) for k, v in ref.items()}, f"{what} params")
        assert all(torch.equal(a, b) for a, b in zip(r["states"], r["states_after"])), f"{what}: optimizer states"
        if dtype == "fp32":  # the first forward after the load computes with the loaded params, none stale
            expected = lm_loss(plain(local(x, rank, 2)), local(y, rank, 2)).item()
            assert r["loss"] == pytest.approx(expected, rel=1e-6), what
        assert tuple(r["partial"]) == (["norm.bias"], [])  # strict=False: the rest is loaded, norm.bias kept
        after, before = r["after_partial"], r["before"]
        _assert_equal({k: v for k, v in after.items() if k != "norm.bias"},
                      {k: v for k, v in before.items() if k != "norm.bias"}, f"{what} partial")
        assert not torch.equal(after["norm.bias"], before["norm.bias"]), what


# A model bigger than a rank's memory cap -----------------------------------

# 134M params, 537 MB in fp32. Stage 3 on 4 ranks with SGD holds a quarter
# of the params and of the grads, 268 MB a rank (AdamW's two moments would
# make a rank's share as big as the full params at 4 ranks); with the gather
# pool, the reduction's staging and the 21 threads wrap starts (gloo groups,
# the comm queues and streams, the positions' publisher: up to 8 MB of stack
# each, which the cap counts), 405 MB: under a cap the full params do not
# fit in, with room for a few threads more (84M params under a 288 MB cap
# left none once wrap started 21 threads).
DEPTH, WIDTH = 128, 1024
CAP = 480 << 20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


class _Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))


def _vm_data() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmData:")) << 10


def _wrap_under_cap(rank, world):
    # RLIMIT_DATA caps the address space a process has allocated. glibc keeps
    # freed blocks to reuse (its mmap threshold rises to the largest freed),
    # and a heap holed by them grows past what is live; pinned, every large
    # block is a mapping of its own, returned when freed, so the cap counts
    # what is allocated.
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 << 10)
    torch.manual_seed(SEED)
    with zerocore.init():
        model = _Deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (_vm_data() + CAP, hard))
    try:
        with pytest.raises(RuntimeError, match="can.t allocate memory"):  # the cap is real
            torch.empty(sum(p.numel() for p in model.parameters()))
        engine = zerocore.wrap(model, opt, zerocore.Config(stage=3, bucket_bytes=4 << 20))
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    torch.distributed.barrier()  # no rank leaves while another still sets up its groups
    # The last layer's stretches on this rank: drawn after every other layer's.
    group, index = engine._places()[id(model.layers[-1].weight)]
    return [(first, values.clone()) for i, first, values in group.owned_stretches(group.fp32_partition())
            if i == index]


def test_a_model_bigger_than_the_memory_cap_wraps_under_it():
    results = run_ranks(_wrap_under_cap, 4, timeout=120)
    torch.manual_seed(SEED)
    eager = _Deep().layers[-1].weight.detach().reshape(-1)
    assert eager.numel() * 4 * DEPTH > CAP
    covered = 0
    for rank, stretches in enumerate(results):
        for first, values in stretches:
            assert torch.equal(values, eager[first:first + values.numel()]), f"rank {rank} at {first}"
            covered += values.numel()
    assert covered == eager.numel()
