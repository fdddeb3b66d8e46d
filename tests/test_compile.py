"""torch.compile with the engine trains as eager does (fp32, 2 ranks, to
fp32 rounding): a compiled engine and compiled blocks (block.compile() or
torch.compile(block) before wrap) at every stage, and at stage 3 a compiled
train step and a compiled module (model.compile() after wrap,
torch.compile(model) before it), with the engine's hooks and native calls
outside the graphs. What cannot work raises saying what to do instead.

Most runs use the aot_eager backend (AOTAutograd's compiled forward and
backward, which is what the hooks and saved-tensor packing meet, without
code generation); one runs the default inductor backend.
"""
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import zerocore
from dist_harness import run_ranks
from models import assert_state_close, lm_batch, lm_loss, local, make

STEPS = 3
HP = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99))
TOL = dict(rtol=1e-5, atol=1e-6)


MODES = ("eager", "torch.compile(engine)", "model.compile() after wrap", "torch.compile(model) before wrap",
         "block.compile() before wrap", "torch.compile(block) before wrap")


def run(stage, mode, backend="aot_eager", fullgraph=False, whole_step=False, buffer=False) -> dict:
    """A training run: `mode` (MODES) says what is compiled; whole_step:
    the train step too; buffer: the model has a buffer (which the engine
    broadcasts before each forward)."""
    return dict(stage=stage, mode=mode, backend=backend, fullgraph=fullgraph, whole_step=whole_step, buffer=buffer)


def _wrapped(stage, mode, options, buffer):
    """The engine and the forward to call."""
    model = make()
    if buffer:
        model.blocks[0].register_buffer("scale", torch.ones(3))
    if mode == "torch.compile(model) before wrap":
        model = torch.compile(model, **options)
    elif mode == "block.compile() before wrap":
        for block in model.blocks:
            block.compile(**options)
    elif mode == "torch.compile(block) before wrap":  # the wrappers take the blocks' places
        model.blocks = torch.nn.ModuleList(torch.compile(block, **options) for block in model.blocks)
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), **HP), zerocore.Config(stage=stage))
    if mode == "torch.compile(engine)":
        return engine, torch.compile(engine, **options)  # a function: the forward (the engine keeps the rest)
    if mode == "model.compile() after wrap":
        model.compile(**options)
    return engine, engine


def train(rank, world, r):
    """Per-step losses, the final full state (named as the plain model's)
    and the number of graphs dynamo compiled, for run `r`."""
    torch._dynamo.reset()
    if r["backend"] == "inductor":
        torch._inductor.config.compile_threads = 1  # no pool of compile workers in each rank
    counter = CompileCounterWithBackend(r["backend"])
    options = dict(backend=counter, fullgraph=r["fullgraph"])
    engine, forward = _wrapped(r["stage"], r["mode"], options, r["buffer"])

    def step(x, y):
        loss = lm_loss(forward(x), y)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        return loss.detach()

    if r["whole_step"]:
        step = torch.compile(step, **options)
    losses = []
    for s in range(STEPS):
        x, y = lm_batch(s, 0, world)
        losses.append(step(local(x, rank, world), local(y, rank, world)))
    state = {k.replace("_orig_mod.", ""): v for k, v in engine.full_state_dict().items()}
    return torch.stack(losses), state, counter.frame_count


def train_all(rank, world, runs):
    return [train(rank, world, r) for r in runs]


def check_against_eager(compiled):
    """Trains each run and its eager counterpart (same stage, model and
    data) on 2 ranks; they must agree to fp32 rounding."""
    eager = [dict(r, mode="eager", whole_step=False, fullgraph=False) for r in compiled]
    results = run_ranks(train_all, 2, compiled + eager, timeout=300)
    for rank in range(2):
        for i, r in enumerate(compiled):
            got, ref = results[rank][i], results[rank][len(compiled) + i]
            what = f"rank {rank} {r}"
            assert got[2] >= 1, f"{what}: nothing was compiled"
            torch.testing.assert_close(got[0], ref[0], **TOL, msg=lambda m: f"{what}: losses: {m}")
            assert_state_close(got[1], ref[1], **TOL, what=what)


def test_compiled_engine_matches_eager_at_every_stage():
    # Stages 0-2: the engine's forward is one graph, so fullgraph=True holds
    # (a buffer's broadcast is a graph break before it); stage 3: graph
    # breaks at the units' hooks; a compiled train step.
    check_against_eager([run(stage, "torch.compile(engine)", fullgraph=stage < 3) for stage in (0, 1, 2, 3)] +
                        [run(2, "torch.compile(engine)", buffer=True), run(3, "eager", whole_step=True)])


def test_compiled_modules_match_eager():
    # torch.compile(block, fullgraph=True) holds at stage 3: a unit's hooks
    # are on the wrapper module, outside its graph.
    check_against_eager([run(3, mode, fullgraph=mode == "torch.compile(block) before wrap") for mode in MODES[2:]] +
                        [run(2, "model.compile() after wrap")])


def test_compiled_blocks_match_eager_at_stages_0_to_2():
    # Blocks hold no hooks of the engine below stage 3: fullgraph=True holds.
    check_against_eager([run(stage, mode, fullgraph=True) for stage in (0, 1, 2)
                         for mode in ("block.compile() before wrap", "torch.compile(block) before wrap")])


def test_inductor_matches_eager_at_stage_3():
    # Inductor's one-time set-up (compiler checks, its precompiled header)
    # here, once: both ranks fork from this process instead of each doing it.
    with torch._inductor.config.patch(compile_threads=1), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, importing inductor
        torch.compile(lambda x: x + 1)(torch.ones(2))
    check_against_eager([run(3, "torch.compile(engine)", backend="inductor")])


def _fails(rank, world, what):
    if what in (2, 3):  # compiled autograd at that stage
        engine, _ = _wrapped(what, "eager", {}, buffer=False)
        x, y = lm_batch(0, 0, world)
        loss = lm_loss(engine(local(x, rank, world)), local(y, rank, world))
        with torch._dynamo.config.patch(compiled_autograd=True):
            torch.compile(lambda: engine.backward(loss), backend="aot_eager")()
    else:
        train(rank, world, what)


@pytest.mark.parametrize("what, message", [
    (run(3, "torch.compile(engine)", fullgraph=True),
     "compile each unit with torch.compile(unit, fullgraph=True) before zerocore.wrap"),
    (run(1, "torch.compile(engine)", fullgraph=True, buffer=True),
     "for fullgraph=True compile the module (model.compile(fullgraph=True)), not the engine"),
    (run(2, "eager", fullgraph=True, whole_step=True),
     "for fullgraph=True compile the forward alone (torch.compile(engine) or model.compile())"),
    (2, "Leave compiled autograd off (torch._dynamo.config.compiled_autograd = False)"),
    (3, "Leave compiled autograd off (torch._dynamo.config.compiled_autograd = False)"),
], ids=["fullgraph stage 3", "fullgraph buffers", "fullgraph step", "compiled autograd stage 2",
        "compiled autograd stage 3"])
def test_what_cannot_work_says_what_to_do(what, message):
    for result in run_ranks(_fails, 2, what, raise_errors=False, timeout=120):
        assert isinstance(result, Exception) and message in result.message, result
