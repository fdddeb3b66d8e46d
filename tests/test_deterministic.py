"""Config(deterministic=True): the same bits at any world size
(docs/deterministic.md). One training job of M = 12 micro-batches a step,
run at world sizes 1, 2, 3 and 4, each with two assignments of the
micro-batches to ranks (contiguous blocks run backwards; a random deal),
against the job at world size 1 in plain order: the fp32 params, every
optimizer state, the loss scale, each step's result and clip norm, bitwise
(torch.equal), assembled from every rank. Cases: stages 0-3; fp32, bf16
and fp16 (dynamic loss scale, with an overflow that skips a step); AdamW,
SGD with momentum; clipping (max_grad_norm and clip_grad_norm_); buckets
that straddle ranks; stage 3's persist_threshold; the optimizer, and at
stage 3 the params, offloaded to the host, with and without the delayed
update; grads that fall outside the first step's grid (a skipped step, a
wider grid); late grads (reentrant checkpointing at stage 2: a grad after
its bucket was reduced). A checkpoint saved at 4 ranks continues at 3 with
the same bits, and docs/deterministic.md's example gives the same bits at 1
and 3 ranks. The world-1 job's SGD cases are checked against
single-process torch in float64 (the mean of the micro-batches' grads)."""
import math
from pathlib import Path

import pytest
import torch

import zerocore
from dist_harness import run_ranks
from models import LateGrads, TinyLM, lm_batch, lm_loss
from zerocore.state.exact_grads import add_on_grid_with_torch, as_int64, in_grid_units, sums_of_squares
from readme import blocks

M = 12  # micro-batches a step: every world size 1-4 divides it
STEPS = 3


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


# name: (Config fields, optimizer, loss factor (step, micro) -> float, clip_grad_norm_ bound)
CASES = {
    "stage0-fp32-adamw-clip": (dict(stage=0), _adamw, None, 0.3),
    "stage1-fp32-sgd": (dict(stage=1), _sgd, None, None),
    "stage1-bf16-adamw-clip": (dict(stage=1, dtype="bf16", max_grad_norm=0.5), _adamw, None, None),
    "stage0-fp16-overflow": (dict(stage=0, dtype="fp16", loss_scale=zerocore.DynamicLossScale(initial=2.0**10, window=2)), _adamw,
                             lambda step, micro: float("inf") if (step, micro) == (1, 5) else 1.0, None),
    "stage1-fp32-offload-delayed": (dict(stage=1, offload_optimizer="cpu", delayed_update=True,
                                         delayed_update_warmup=1), _adamw, None, 1.0),
    "stage2-fp32-sgd-clip-regrid": (dict(stage=2, max_grad_norm=0.5, bucket_bytes=1024), _sgd,
                                    lambda step, micro: 2.0**40 if step == 0 else 1.0, None),
    "stage2-fp16-offload-delayed-overflow": (dict(stage=2, dtype="fp16", offload_optimizer="cpu", delayed_update=True,
                                                  delayed_update_warmup=1,
                                                  loss_scale=zerocore.DynamicLossScale(initial=2.0**10)),
                                     _adamw, lambda step, micro: float("inf") if (step, micro) == (1, 5) else 1.0,
                                     None),
    "stage3-bf16-adamw-clip": (dict(stage=3, dtype="bf16"), _adamw, None, 0.5),
    "stage3-fp32-persist": (dict(stage=3, persist_threshold=100, bucket_bytes=1024), _adamw, None, None),
    "stage3-fp32-offload-params": (dict(stage=3, offload_optimizer="cpu", offload_params="cpu"), _sgd, None, 1.0),
    "stage3-bf16-offload-delayed": (dict(stage=3, dtype="bf16", offload_optimizer="cpu", offload_params="cpu",
                                         delayed_update=True, delayed_update_warmup=1), _adamw, None, 0.5),
    "stage2-fp32-sgd-late": (dict(stage=2, bucket_bytes=512), _sgd, None, None),
}
MODELS = {"stage2-fp32-sgd-late": LateGrads}  # the rest train TinyLM
# Updates from step 2 on delayed.
DELAYED = ("stage1-fp32-offload-delayed", "stage2-fp16-offload-delayed-overflow", "stage3-bf16-offload-delayed")
REGRID = "stage2-fp32-sgd-clip-regrid"  # step 0's grads beyond the first grid: skipped, the grid widened
OVERFLOWS = ("stage0-fp16-overflow", "stage2-fp16-offload-delayed-overflow")  # an inf loss in step 1: skipped, the scale halved


def assignments(world, seed):
    """Two assignments of the M micro-batches to ranks, as each rank's list
    in the order it runs them: contiguous blocks backwards, and a random deal."""
    per = M // world
    blocks = [list(range(r * per, (r + 1) * per))[::-1] for r in range(world)]
    deal = torch.randperm(M, generator=torch.Generator().manual_seed(seed)).tolist()
    return {"blocks-backwards": blocks, "random-deal": [deal[r::world] for r in range(world)]}


def _states(engine) -> dict:
    """This rank's stretches of the fp32 params and optimizer states: {(kind, name): [(first, values)]}."""
    engine.finish_update()  # a delayed update still running lands first
    out = {}
    for g in engine.parts.groups:
        for kind, buf in {"param": g.fp32_partition(), **g.optimizer_states()}.items():
            for index, first, values in g.owned_stretches(buf):
                out.setdefault((kind, g.names[index][0]), []).append((first, values.clone()))
    return out


def _assemble(per_rank) -> dict:
    """Every rank's stretches, whole: {(kind, name): flat tensor}."""
    pieces = {}
    for states in per_rank:
        for key, stretches in states.items():
            for first, values in stretches:
                pieces.setdefault(key, {})[first] = values
    return {key: torch.cat([v for _, v in sorted(by_first.items())]) for key, by_first in pieces.items()}


def _train(engine, rank, order, case, steps, first_step=0):
    """`steps` steps; this rank runs the micro-batches order[rank] of each.
    Returns, per step, what the step returned, the clip norm, the loss
    scale and whether an update is left pending (delayed)."""
    _, _, factor, clip = CASES[case]
    results = []
    for step in range(first_step, first_step + steps):
        for micro in order[rank]:
            x, y = lm_batch(step, micro, 1)
            loss = lm_loss(engine(x), y) * (factor(step, micro) if factor else 1.0)
            engine.backward(loss)
        norm = float(engine.clip_grad_norm_(clip)) if clip else None
        results.append((engine.step(), norm, engine.loss_scale, getattr(engine.parts.update, "pending", False)))
        engine.zero_grad()
        if step == STEPS - 2:  # where the resume test saves, which lands a delayed update: every job lands it
            engine.finish_update()
    return results


def _wrap(case, seed):
    fields, make_opt, _, _ = CASES[case]
    torch.manual_seed(seed)
    model = MODELS.get(case, TinyLM)()
    return zerocore.wrap(model, make_opt(model.parameters()), zerocore.Config(deterministic=True, **fields))


def _run_cases(rank, world, order, seed, checkpoint=None, resume=None):
    """Every case on these ranks; checkpoint: save after STEPS - 1 steps
    there and stop; resume: load from there and run the last step."""
    out = {}
    for case in CASES:
        engine = _wrap(case, seed)
        if resume is not None:
            engine.load(f"{resume}/{case}")
            results = _train(engine, rank, order, case, 1, first_step=STEPS - 1)
        elif checkpoint is not None:
            results = _train(engine, rank, order, case, STEPS - 1)
            engine.save(f"{checkpoint}/{case}")
        else:
            results = _train(engine, rank, order, case, STEPS)
        out[case] = (results, _states(engine), engine.step_count)
        engine.close()
    return out


def _jobs(world, order, seed, **kw):
    """{case: (per-step results, assembled states, step count)} of the job on `world` ranks."""
    per_rank = run_ranks(lambda rank, w: _run_cases(rank, w, order, seed, **kw), world, timeout=120)
    out = {}
    for case in CASES:
        results = [r[case][0] for r in per_rank]
        assert all(res == results[0] for res in results), f"{case}: ranks disagree on the steps: {results}"
        out[case] = (results[0], _assemble([r[case][1] for r in per_rank]), per_rank[0][case][2])
    return out


def _assert_same_bits(got, ref, what):
    for case in CASES:
        assert got[case][0][-len(ref[case][0]):] == ref[case][0][-len(got[case][0]):], \
            f"{what} {case}: step results {got[case][0]} != {ref[case][0]}"
        assert got[case][2] == ref[case][2], f"{what} {case}: step count"
        states, ref_states = got[case][1], ref[case][1]
        assert states.keys() == ref_states.keys(), f"{what} {case}"
        for key in ref_states:
            assert torch.equal(states[key], ref_states[key]), \
                f"{what} {case} {key}: {(states[key] - ref_states[key]).abs().max()} off"


_reference = {}


def reference(seed):
    """The job at world size 1, micro-batches in plain order."""
    if seed not in _reference:
        _reference[seed] = _jobs(1, [list(range(M))], seed)
    return _reference[seed]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_same_bits_at_any_world_size(world, zerocore_seed):
    ref = reference(zerocore_seed)
    for name, order in assignments(world, zerocore_seed).items():
        _assert_same_bits(_jobs(world, order, zerocore_seed), ref, f"world {world}, {name}:")


def test_expected_skips(zerocore_seed):
    """The cases skip the steps they are built to skip, and train the rest."""
    ref = reference(zerocore_seed)
    applied = {case: [r[0] for r in ref[case][0]] for case in CASES}
    for case in OVERFLOWS:
        assert applied[case] == [True, False, True], case
        scales = [r[2] for r in ref[case][0]]
        assert scales[1] == scales[0] / 2, case  # the overflow halved the loss scale
    assert applied[REGRID] == [False, True, True]
    assert all(applied[c] == [True] * STEPS for c in CASES if c not in OVERFLOWS + (REGRID,))
    pending = {case: [r[3] for r in ref[case][0]] for case in CASES}
    for case in DELAYED:  # after the warm-up step, an applied step leaves its update running
        assert pending[case] == [False] + applied[case][1:], case
    assert not any(any(pending[c]) for c in CASES if c not in DELAYED)


def test_resume_from_4_ranks_at_3(tmp_path, zerocore_seed):
    ref = reference(zerocore_seed)
    orders = assignments(4, zerocore_seed)["random-deal"], assignments(3, zerocore_seed)["blocks-backwards"]
    _jobs(4, orders[0], zerocore_seed, checkpoint=str(tmp_path))
    _assert_same_bits(_jobs(3, orders[1], zerocore_seed, resume=str(tmp_path)), ref, "saved at 4, resumed at 3:")


@pytest.mark.parametrize("case", ["stage1-fp32-sgd", "stage2-fp32-sgd-late"])
def test_mean_of_micro_batches_against_float64(case, zerocore_seed):
    """The world-1 job's SGD cases against torch in float64: the step's
    gradient is the mean of its micro-batches' (each loss unscaled), late
    grads included."""
    torch.manual_seed(zerocore_seed)
    model = MODELS.get(case, TinyLM)().double()
    opt = _sgd(model.parameters())
    for step in range(STEPS):
        for micro in range(M):
            x, y = lm_batch(step, micro, 1)
            (lm_loss(model(x), y) / M).backward()
        opt.step()
        opt.zero_grad()
    got = reference(zerocore_seed)[case][1]
    want = model.state_dict()
    params = [name for kind, name in got if kind == "param"]
    assert len(params) == len(list(model.parameters()))
    for name in params:
        torch.testing.assert_close(got[("param", name)].double(), want[name].reshape(-1), rtol=1e-5, atol=1e-6)


def test_docs_example(tmp_path):
    """docs/deterministic.md's example, as written: the same bits at 1 and 3 ranks."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "deterministic.md").read_text()
    (example,) = blocks(text, "python")
    namespace = {}
    exec(compile(example, "docs/deterministic.md", "exec"), namespace)
    one, three = run_ranks(namespace["train"], 1)[0], run_ranks(namespace["train"], 3)
    for state in three:
        assert state.keys() == one.keys() and all(torch.equal(state[k], one[k]) for k in one)


def _grad_bytes(rank, world):
    """memory_report()'s grad bytes, default and deterministic, at stages 1
    and 3; at stage 3 whether the sums lie in the grad partitions' memory."""
    out = {}
    for stage in (1, 3):
        for det in (False, True):
            torch.manual_seed(0)
            model = TinyLM()
            engine = zerocore.wrap(model, _sgd(model.parameters()), zerocore.Config(stage=stage, deterministic=det))
            shared = ["grad_sums" in g.buffers
                      and g.buffers["grad_sums"].data_ptr() == g.buffers["grad_part"].data_ptr()
                      for g in engine.parts.groups if g.trainable]
            out[stage, det] = engine.memory_report()["grad"], shared
            engine.close()
    return out


def test_memory_report_counts_the_sums():
    """Stage 1 keeps int64 sums beside the whole fp32 grads (3x their
    bytes); at stage 3 they are the grad partition's own memory, 5 bytes
    an element (int40) where the grads take 4."""
    got = run_ranks(_grad_bytes, 2)[0]
    assert got[1, True][0] == 3 * got[1, False][0] and not any(got[1, True][1])
    assert 4 * got[3, True][0] == 5 * got[3, False][0] and all(got[3, True][1]) and got[3, True][1]


def _on_grid_both_ways(grads, exponent, before, top=0.0):
    """(sums, largest) after the native accumulate_on_grid and after the
    torch ops a GPU runs (exact_grads.add_on_grid_with_torch), from the
    same sums and largest."""
    out = []
    for add in (zerocore._native.accumulate_on_grid, add_on_grid_with_torch):
        sums, largest = before.clone(), torch.tensor([top])
        add(sums, grads, exponent, largest)
        out.append((sums, largest.item()))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_accumulate_on_grid_against_torch(dtype):
    """The native grid kernel against torch's float64 round, ties to even,
    added into int64 sums, and the largest |grad| it keeps: random grads
    over 30 binades, exact ties; a largest already larger stays; past 2**51
    and past int64, and not finite, the largest alone (it skips the step:
    the sums are not read then)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    grads = (torch.randn(4099, generator=g) * 2.0 ** torch.randint(-20, 10, (4099,), generator=g)).to(dtype)
    exponent = -12
    grads[:8] = torch.tensor([0.5, 1.5, -2.5, -0.5, 3.5, 2.0**-13, -(2.0**-13), 0.0]).mul(2.0**exponent).to(dtype)
    before = torch.randint(-(2**40), 2**40, (grads.numel(),), dtype=torch.int64, generator=g)
    (native, native_top), (torch_sums, torch_top) = _on_grid_both_ways(grads, exponent, before)
    assert torch.equal(native, torch_sums)
    assert native_top == torch_top == grads.abs().max().item()
    assert (native - before)[:8].tolist() == [0, 2, -2, 0, 4, 0, 0, 0]  # ties to even
    assert in_grid_units(native_top, exponent) == max(abs(x) for x in (native - before).tolist())
    assert _on_grid_both_ways(grads, exponent, before, top=1e6)[0][1] == 1e6
    if dtype != torch.float16:  # past 2**51, and past int64
        big = torch.tensor([2.0**52 + 2.0**30, -(2.0**60), 2.0**70], dtype=dtype)
        tops = [top for _, top in _on_grid_both_ways(big, 0, before[:3])]
        assert tops == [2.0**70] * 2 and in_grid_units(2.0**70, 0) == 2.0**70
    for bad in (float("nan"), float("inf")):
        grads[7] = bad
        tops = [top for _, top in _on_grid_both_ways(grads, exponent, before)]
        assert not any(math.isfinite(t) for t in tops) and in_grid_units(tops[0], exponent) == math.inf
    with pytest.raises(TypeError, match="dst must be int64"):
        zerocore._native.accumulate_on_grid(grads, grads, exponent, torch.zeros(1))
    with pytest.raises(TypeError, match="largest must be one float32"):
        zerocore._native.accumulate_on_grid(before, grads, exponent, torch.zeros(2))


def _random_runs(n, g):
    """Runs (first, length) in order over n elements, with gaps between some."""
    cuts = sorted(set(torch.randint(0, n, (12,), generator=g).tolist()) | {0, n})
    return [(lo, hi - lo) for k, (lo, hi) in enumerate(zip(cuts, cuts[1:])) if k % 3 != 1]


def _packed_int40(values: torch.Tensor) -> torch.Tensor:
    return torch.tensor([[(v >> (8 * b)) & 0xFF for b in range(5)] for v in values.tolist()], dtype=torch.uint8)


def test_exact_sums_of_squares_against_python_ints():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    sums = torch.randint(-(2**62), 2**62, (5000,), dtype=torch.int64, generator=g)
    sums[:3] = torch.tensor([2**63 - 1, -(2**63) + 1, 0])
    runs = _random_runs(sums.numel(), g)
    values = sums.tolist()
    assert sums_of_squares(sums, runs) == [sum(x * x for x in values[a:a + n]) for a, n in runs]
    with pytest.raises(ValueError, match="in order, apart"):
        sums_of_squares(sums, [(10, 5), (12, 3)])


def test_int40_sums_read_back_exactly():
    """A partition's int40 sums (n x 5 bytes, two's complement) as int64
    (exact_grads.as_int64, torch's ops) and their native sums of squares,
    against Python ints, over the whole range [-2**39, 2**39)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    values = torch.randint(-(2**39), 2**39, (3001,), dtype=torch.int64, generator=g)
    values[:5] = torch.tensor([2**39 - 1, -(2**39), -1, 0, 1])
    packed = _packed_int40(values)
    assert torch.equal(as_int64(packed), values)
    assert sums_of_squares(packed, [(0, 3001)]) == [sum(x * x for x in values.tolist())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("packed", [False, True])
def test_native_mean_is_torchs_to_the_bit(dtype, packed):
    """The step's mean on the host (one native pass, _native.mean_of_sums)
    gives the bits of the torch ops a GPU's sums take (double(sum) *
    2**exponent / count, then the grads' dtype), padding zeros; int40 sums
    with the grads in their own first bytes, as a grad partition holds them."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    n, count = 4000, 6
    values = torch.randint(-(2**39), 2**39, (n,), dtype=torch.int64, generator=g)
    runs = [(a, length, int(torch.randint(-160, 10, (), generator=g)) if k % 4 else None)
            for k, (a, length) in enumerate(_random_runs(n, g))]
    expected = torch.full((n,), 7.0, dtype=dtype)  # elements outside the runs are left as they were
    for a, length, exponent in runs:
        expected[a:a + length] = 0 if exponent is None else values[a:a + length].double() * 2.0**exponent / count
    if packed:
        sums = _packed_int40(values)
        grads = sums.view(-1)[:n * dtype.itemsize].view(dtype)
        untouched = [(a, b) for (a, b) in zip([0] + [r[0] + r[1] for r in runs], [r[0] for r in runs] + [n])]
        for a, b in untouched:  # what the step leaves of them reads as the sums' bytes: not compared
            expected[a:b] = grads[a:b]
    else:
        sums, grads = values, torch.full((n,), 7.0, dtype=dtype)
    zerocore._native.mean_of_sums(sums, grads, runs, count)
    assert torch.equal(grads.view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                       expected.view(torch.int16 if dtype.itemsize == 2 else torch.int32))


def test_config_refuses_a_non_bool():
    with pytest.raises(ValueError, match="deterministic"):
        zerocore.Config(deterministic=1)
