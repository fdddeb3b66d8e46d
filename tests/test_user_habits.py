"""A PyTorch user's habits with a wrapped model: each one trains as torch
does, or raises a clear error naming what to call instead, on every rank
that uses it and without a hang. Against single-process torch on the same
global batch (models.reference_train), at every stage."""
import os
import signal
import tempfile
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocore
from zerocore.runtime import devices
from dist_harness import RankError, run_ranks
from models import assert_state_close, lm_batch, lm_loss, local, make, reference_train

STAGES = (0, 1, 2, 3)
STEPS = 4


def sgd(params):
    return torch.optim.SGD(params, lr=0.2)


# The user's optimizer drives the engine -------------------------------------

def _classic_loop(rank, world, stage, scheduler_before_wrap):
    """engine.backward, then the user's own opt.step() and opt.zero_grad(),
    with an lr scheduler on the user's optimizer made before or after wrap."""
    model = make()
    opt = sgd(model.parameters())
    make_scheduler = lambda: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # noqa: E731
    scheduler = make_scheduler() if scheduler_before_wrap else None
    engine = zerocore.wrap(model, opt, zerocore.Config(stage=stage, bucket_bytes=512))
    scheduler = scheduler or make_scheduler()
    assert engine.optimizer is opt
    for step in range(STEPS):
        x, y = lm_batch(step, 0, world)
        engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
        opt.step()
        opt.zero_grad()
        scheduler.step()
    assert all(p.grad is None for p in model.parameters())
    return engine.full_state_dict()


@pytest.mark.parametrize("scheduler_before_wrap", [True, False])
def test_the_users_optimizer_and_its_scheduler_drive_the_engine(scheduler_before_wrap):
    model = make()
    opt = sgd(model.parameters())
    ref = reference_train(model, opt, STEPS, 1, 2, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    for stage in STAGES:
        for rank, got in enumerate(run_ranks(_classic_loop, 2, stage, scheduler_before_wrap)):
            assert_state_close(got, ref, rtol=1e-5, atol=1e-5, what=f"stage {stage} rank {rank}")


def _optimizer_misuse(rank, world):
    model = make()
    opt = sgd(model.parameters())
    engine = zerocore.wrap(model, opt, zerocore.Config(stage=2))
    errors = {}
    for what, call in [("state_dict", opt.state_dict), ("load_state_dict", lambda: opt.load_state_dict({})),
                       ("add_param_group", lambda: opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]})),
                       ("step(closure)", lambda: opt.step(lambda: 0.0)),
                       ("second wrap", lambda: zerocore.wrap(make(), opt, zerocore.Config(stage=0)))]:
        try:
            call()
        except (NotImplementedError, ValueError) as e:
            errors[what] = str(e)
    engine.close()
    try:
        opt.step()
    except RuntimeError as e:
        errors["after close"] = str(e)
    # Wrapped again, the same optimizer drives the new engine.
    engine = zerocore.wrap(model, opt, zerocore.Config(stage=2))
    x, y = lm_batch(0, 0, world)
    engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    return errors, opt.step()


def test_what_the_users_optimizer_cannot_do_raises_naming_the_fix():
    for errors, stepped in run_ranks(_optimizer_misuse, 2):
        assert "engine.save(path)" in errors["state_dict"]
        assert "engine.load(path)" in errors["load_state_dict"]
        assert "every param group before zerocore.wrap" in errors["add_param_group"]
        assert "step(closure) is not supported" in errors["step(closure)"]
        assert "already drives an engine" in errors["second wrap"]
        assert "engine was closed" in errors["after close"]
        assert stepped is True


# Grads: clip_grad_norm_ and reading .grad -----------------------------------

def _clip(rank, world, stage, max_norm):
    model = make()
    opt = sgd(model.parameters())
    engine = zerocore.wrap(model, opt, zerocore.Config(stage=stage, bucket_bytes=512))
    norms, errors = [], []
    for step in range(STEPS):
        for micro in range(2):
            x, y = lm_batch(step, micro, world)
            engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
        for use in (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm),
                    lambda: model.blocks[0].up.weight.grad.norm()):
            try:
                use()
            except RuntimeError as e:
                errors.append(str(e))
        norms.append(engine.clip_grad_norm_(max_norm).item())
        opt.step()
        opt.zero_grad()
    return norms, errors, engine.full_state_dict()


def test_clip_grad_norm_returns_torchs_norm_and_clips_where_torch_does():
    """SGD and accumulation 2, so that a wrong scale of the grads or the norm
    shows; max_norm between the steps' norms, so that some steps clip and
    some do not. torch.nn.utils.clip_grad_norm_ on the params, and any read
    of a .grad, raise naming engine.clip_grad_norm_."""
    model = make()
    opt = sgd(model.parameters())
    torch_norms = []

    class ClipThenStep:
        def step(self):
            torch_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
            opt.step()

        def zero_grad(self):
            opt.zero_grad()

    free = make()
    free_norms = []

    class Measure:  # the unclipped run's norms, to place max_norm among them
        def step(self):
            free_norms.append(torch.nn.utils.clip_grad_norm_(free.parameters(), float("inf")).item())
            free_opt.step()

        def zero_grad(self):
            free_opt.zero_grad()

    free_opt = sgd(free.parameters())
    reference_train(free, Measure(), STEPS, 2, 2)
    max_norm = sorted(free_norms)[len(free_norms) // 2]
    ref = reference_train(model, ClipThenStep(), STEPS, 2, 2)
    assert min(torch_norms) < max_norm < max(torch_norms), "max_norm must clip some steps and not others"
    for stage in STAGES:
        for rank, (norms, errors, got) in enumerate(run_ranks(_clip, 2, stage, max_norm)):
            what = f"stage {stage} rank {rank}"
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(torch_norms), rtol=1e-5, atol=0,
                                       msg=lambda m: f"{what}: {m}")
            assert_state_close(got, ref, rtol=1e-5, atol=1e-5, what=what)
            assert len(errors) == 2 * STEPS
            for e in errors:
                assert f"at stage {stage} the engine keeps the grads" in e and "engine.clip_grad_norm_" in e, e


# Devices and process groups ---------------------------------------------------

def test_the_device_decision(monkeypatch):
    # Where CUDA cannot be used (test_engine_backend.py has where it can).
    monkeypatch.setattr(devices, "cuda_usable", lambda: False)
    cpu, meta, cuda = torch.device("cpu"), torch.device("meta"), torch.device("cuda", 0)
    assert devices.tensor_problem([("a", cpu), ("b", meta)]) is None
    message = devices.tensor_problem([("a", cpu), ("w", cuda), ("bn.running_mean", cuda)])
    assert "w (cuda:0), bn.running_mean (cuda:0) are not on the CPU" in message and "model.cpu()" in message
    assert devices.group_problem(("cpu", "cuda"), "gloo") is None
    assert devices.group_problem(("cpu",), "cpu:gloo") is None
    assert "(nccl) cannot move cpu tensors" in devices.group_problem(("cuda",), "nccl")
    assert devices.device_types("cpu:gloo,cuda:nccl") == ("cpu", "cuda")
    assert devices.device_types("nccl") == ("cuda",)
    assert "cpu" in devices.device_types("gloo")


def _cuda_param(rank, world, where):
    from torch._subclasses.fake_tensor import FakeTensorMode

    devices.cuda_usable = lambda: False  # on a GPU machine too: a CUDA tensor beside CPU ones is refused either way
    model = make()
    with FakeTensorMode():  # a CPU-only torch can make a tensor that says it is on a GPU only this way
        on_gpu = torch.empty(4, device="cuda")
    if where == "param" or rank == 0:  # a buffer on one rank only: the others must raise too
        if where == "param":
            model.extra = nn.Parameter(on_gpu)
        else:
            model.register_buffer("stat", on_gpu)
    zerocore.wrap(model, sgd(model.parameters()), zerocore.Config(stage=3))


def _nccl_only(rank, world):
    dist.get_backend_config = lambda group=None: "nccl"  # what a group without a CPU backend reports
    model = make()
    zerocore.wrap(model, sgd(model.parameters()), zerocore.Config(stage=3))


def test_wrap_refuses_gpu_tensors_and_groups_without_a_cpu_backend_on_every_rank():
    for results in (run_ranks(_cuda_param, 2, "param", raise_errors=False),):
        for r in results:
            assert isinstance(r, RankError) and r.exc_type == "ValueError"
            assert "extra (cuda:0) is not on the CPU" in r.message, r.message
    buffer_on_rank_0 = run_ranks(_cuda_param, 2, "buffer", raise_errors=False)
    assert "stat (cuda:0) is not on the CPU" in buffer_on_rank_0[0].message
    assert "rank(s) [0] rejected the model" in buffer_on_rank_0[1].message
    for r in run_ranks(_nccl_only, 2, raise_errors=False):
        assert isinstance(r, RankError) and "(nccl) cannot move cpu tensors" in r.message, r


# Stage 3: the module's own state_dict and writes to its params ------------------

def _module_state(rank, world, config, callers):
    model = make()
    engine = zerocore.wrap(model, sgd(model.parameters()), zerocore.Config(**config))
    x, y = lm_batch(0, 0, world)
    engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    engine.step()
    before = engine.full_state_dict()
    new = {k: torch.randn_like(v) for k, v in before.items()}
    new["head.weight"] = new["embed.weight"]  # tied
    errors, got = {}, {}
    if rank in callers:
        for what, call in [("state_dict", lambda: got.setdefault("state_dict", {k: v.clone() for k, v in
                                                                                model.state_dict().items()})),
                           ("load_state_dict", lambda: model.load_state_dict(new)),
                           ("fill_", lambda: model.blocks[1].down.weight.fill_(1.0)),
                           ("copy_", lambda: model.blocks[0].up.weight.copy_(new["blocks.0.up.weight"])),
                           ("init.normal_", lambda: nn.init.normal_(model.blocks[0].up.bias)),
                           ("data.normal_", lambda: model.blocks[0].norm.weight.data.normal_())]:
            try:
                with torch.no_grad():
                    call()
            except RuntimeError as e:
                errors[what] = str(e)
    after = engine.full_state_dict()
    with engine.gathered_params():
        gathered = model.state_dict()
    # The step starts from what was written (lr 0: it changes nothing).
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    engine.step()
    assert_state_close(engine.full_state_dict(), after, rtol=0, atol=0, what="the step after the writes")
    return errors, got.get("state_dict"), before, after, gathered, new


@pytest.mark.parametrize("callers", [(0, 1), (0,)], ids=["every rank", "rank 0 only"])
def test_stage3_module_state_dict_and_writes_raise_on_the_calling_rank(callers):
    for rank, (errors, state, before, after, gathered, _) in enumerate(run_ranks(_module_state, 2, {"stage": 3},
                                                                                   callers)):
        assert state is None
        if rank in callers:
            assert "engine.full_state_dict()" in errors["state_dict"] and "engine.save" in errors["state_dict"]
            assert "engine.load_state_dict(state_dict) on every rank" in errors["load_state_dict"]
            for what in ("fill_", "copy_", "init.normal_", "data.normal_"):
                assert "a stage-3 param that is released" in errors[what], (what, errors)
                assert "engine.gathered_params()" in errors[what]
        else:
            assert errors == {}
        assert_state_close(after, before, rtol=0, atol=0, what="nothing changed")
        assert_state_close(gathered, before, rtol=0, atol=0, what="state_dict() inside gathered_params()")


@pytest.mark.parametrize("config", [{"stage": s, "dtype": d} for s in (0, 1, 2) for d in ("fp32", "bf16")] +
                         [{"stage": 2, "offload_optimizer": "cpu"}, {"stage": 3, "persist_threshold": 10**6}],
                         ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_module_state_dict_and_writes_land_where_params_are_held_whole(config):
    """Stages 0-2, and stage 3's persistent params: the module's own
    state_dict, load_state_dict and in-place writes work, and the writes
    reach the fp32 master (16-bit training, offload) that the step updates."""
    rounded = (lambda t: t.bfloat16().float()) if config.get("dtype") == "bf16" else (lambda t: t)
    for errors, state, before, after, gathered, new in run_ranks(_module_state, 2, config, (0, 1)):
        assert errors == {}
        assert_state_close(state, {k: rounded(v) for k, v in before.items()}, rtol=0, atol=0,
                           what="model.state_dict()")
        # load_state_dict, then the in-place writes after it, all landed.
        assert torch.equal(after["blocks.1.down.weight"], torch.ones_like(new["blocks.1.down.weight"]))
        assert torch.equal(after["blocks.0.up.weight"], rounded(new["blocks.0.up.weight"]))
        assert not torch.equal(after["blocks.0.up.bias"], rounded(new["blocks.0.up.bias"]))  # re-initialised
        assert torch.equal(after["embed.weight"], rounded(new["embed.weight"]))


# Freezing and unfreezing after wrap --------------------------------------------

def _change_trainability(rank, world, stage, change, ranks):
    model = make()
    model.blocks[0].requires_grad_(change == "unfreeze")
    engine = zerocore.wrap(model, sgd(model.parameters()), zerocore.Config(stage=stage, bucket_bytes=512))
    losses = []
    for step in range(2):
        x, y = lm_batch(step, 0, world)
        if step == 1 and rank in ranks:
            model.blocks[0].requires_grad_(change != "unfreeze")
        before = engine.full_state_dict()
        engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
        try:
            engine.step()
        except RuntimeError as e:
            engine.zero_grad()
            return str(e), before, engine.full_state_dict()
        engine.zero_grad()
        losses.append(step)
    return None, None, None


@pytest.mark.parametrize("change", ["unfreeze", "freeze"])
def test_a_change_of_requires_grad_after_wrap_raises_on_every_rank(change):
    for stage in STAGES:
        for ranks in ((0, 1), (1,)):
            for rank, (error, before, after) in enumerate(run_ranks(_change_trainability, 2, stage, change, ranks)):
                assert error is not None, f"stage {stage} rank {rank}: no error"
                if rank in ranks:
                    assert "blocks.0.down.bias" in error and "changed requires_grad after zerocore.wrap" in error
                else:
                    assert "another rank changed requires_grad" in error
                assert "Nothing was updated" in error and "engine.close()" in error
                assert_state_close(after, before, rtol=0, atol=0, what=f"stage {stage}: nothing updated")


# loss.backward() in place of engine.backward(loss) -------------------------------

def _loss_backward(rank, world, stage):
    model = make()
    opt = sgd(model.parameters())
    engine = zerocore.wrap(model, opt, zerocore.Config(stage=stage, bucket_bytes=512))
    before = engine.full_state_dict()
    x, y = lm_batch(0, 0, world)
    error = None
    try:
        lm_loss(engine(local(x, rank, world)), local(y, rank, world)).backward()
        opt.step()
    except RuntimeError as e:
        error = str(e)
    opt.zero_grad()
    unchanged = engine.full_state_dict()
    # engine.backward trains on as if nothing had happened.
    engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    opt.step()
    return error, before, unchanged, engine.full_state_dict()


def test_loss_backward_in_place_of_engine_backward_raises_naming_it():
    model = make()
    ref = reference_train(model, sgd(model.parameters()), 1, 1, 2)
    for stage in STAGES:
        for error, before, unchanged, after in run_ranks(_loss_backward, 2, stage):
            assert error is not None and "engine.backward(loss)" in error, (stage, error)
            assert_state_close(unchanged, before, rtol=0, atol=0, what=f"stage {stage}: nothing changed")
            assert_state_close(after, ref, rtol=1e-5, atol=1e-5, what=f"stage {stage}: the step after")




def _loss_backward_after_engine_backward(rank, world, stage):
    model = make()
    opt = sgd(model.parameters())
    engine = zerocore.wrap(model, opt, zerocore.Config(stage=stage, bucket_bytes=512))
    x, y = lm_batch(0, 0, world)
    engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    try:
        lm_loss(engine(local(x, rank, world)), local(y, rank, world)).backward()
        error = None
    except RuntimeError as e:
        error = str(e)
    opt.step()  # the engine.backward's grads alone
    return error, engine.full_state_dict()


def test_loss_backward_after_engine_backward_raises_naming_it_and_adds_nothing():
    """Stages 0-1 too: zerocore's error, not torch's memory-overlap error
    from the placeholders in .grad."""
    model = make()
    ref = reference_train(model, sgd(model.parameters()), 1, 1, 2)
    for stage in STAGES:
        for error, after in run_ranks(_loss_backward_after_engine_backward, 2, stage):
            assert error is not None and "call engine.backward(loss)" in error, (stage, error)
            assert_state_close(after, ref, rtol=1e-5, atol=1e-5, what=f"stage {stage}: the step after")


# Uneven micro-batch counts -------------------------------------------------------

def _uneven(rank, world, stage):
    """Rank r runs 2 + r micro-batches, then steps; on the error every rank
    zeroes its grads and trains a step of 2 micro-batches."""
    model = make()
    engine = zerocore.wrap(model, sgd(model.parameters()), zerocore.Config(stage=stage, bucket_bytes=512))
    before = engine.full_state_dict()
    start = time.monotonic()
    try:
        for micro in range(2 + rank):
            x, y = lm_batch(0, micro, world)
            engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
        engine.step()
        error = None
    except zerocore.CollectiveOrderError as e:
        error = str(e)
    seconds = time.monotonic() - start
    engine.zero_grad()
    after_error = engine.full_state_dict()
    for micro in range(2):
        x, y = lm_batch(1, micro, world)
        engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    engine.step()
    return error, seconds, before, after_error, engine.full_state_dict()


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_micro_batch_counts_raise_on_every_rank_at_once_naming_both(world):
    """Where the extra micro-batch's collectives would wait for a peer at the
    step (stage 3's rounds in its forward, stage 2's reduce-scatters in its
    backward; none at stages 0-1), every rank raises within seconds, not the
    timeout (the harness's group waits 60 s), and can go on; at 4 ranks (2,
    3, 4 and 5 micro-batches) at stages 1-3."""
    for stage in STAGES if world == 2 else STAGES[1:]:
        results = run_ranks(_uneven, world, stage)
        for rank, (error, seconds, before, after_error, after) in enumerate(results):
            what = f"stage {stage} rank {rank} of {world}"
            assert error is not None, what
            assert "rank 0: at the step after 2 micro-batch(es)" in error, (what, error)
            place = "forward" if stage == 3 else "backward" if stage == 2 else "step"
            assert (f"rank 1: at the {place} of micro-batch 3" if place != "step"
                    else "rank 1: at the step after 3 micro-batch(es)") in error, (what, error)
            assert "Nothing was updated" in error and "engine.zero_grad()" in error, (what, error)
            assert seconds < 10, f"{what}: the error took {seconds:.1f} s"
            assert_state_close(after_error, before, rtol=0, atol=0, what=f"{what}: nothing updated")
            assert_state_close(after, results[0][4], rtol=0, atol=0, what=f"{what}: the ranks train on alike")
            assert not torch.equal(after["blocks.0.up.weight"], before["blocks.0.up.weight"]), what



def _evaluating_mid_step(rank, world, stage, evaluations):
    model = make()
    engine = zerocore.wrap(model, sgd(model.parameters()), zerocore.Config(stage=stage, bucket_bytes=512))
    for step in range(2):
        x, y = lm_batch(step, 0, world)
        engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
        with torch.no_grad():  # forwards with no backward, on every rank (stage 3's rounds stay open)
            for _ in range(evaluations):
                engine(local(x, rank, world))
        engine.step()
    return engine.full_state_dict()


def test_evaluation_forwards_between_backward_and_step_train_as_without():
    """The ranks meet only where none may still wait for another's rounds:
    forwards with no backward between them, then the step, neither hang nor
    raise."""
    for stage in STAGES:
        without = run_ranks(_evaluating_mid_step, 2, stage, 0)
        for rank, got in enumerate(run_ranks(_evaluating_mid_step, 2, stage, 2)):
            assert_state_close(got, without[rank], rtol=0, atol=0, what=f"stage {stage} rank {rank}")


# Ctrl-C at stage 3 ---------------------------------------------------------------

class _Stop(BaseException):
    """A BaseException of the user's own (as SystemExit or KeyboardInterrupt, not an Exception)."""


class _Interrupting(nn.Module):
    """Block `inner`, which raises `error` (KeyboardInterrupt) on its
    forward call number `at` ("forward"), or from a hook on that call's
    output grad ("backward hook")."""

    def __init__(self, inner, where, at, error=KeyboardInterrupt):
        super().__init__()
        self.inner, self.where, self.at, self.error, self.calls = inner, where, at, error, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at and self.where == "forward":
            raise self.error
        out = self.inner(x)
        if self.calls == self.at and self.where == "backward hook":
            out.register_hook(lambda grad: (_ for _ in ()).throw(self.error))
        return out


class _SignalAfter:
    """The native unit schedule, with a SIGINT sent to this process as its
    call `name` returns for the `at`-th time: where a real Ctrl-C comes out,
    since Python runs the handler once the native wait is over."""

    def __init__(self, native, name, at):
        self._native, self._name, self._at, self._calls = native, name, at, 0

    def __getattr__(self, attr):
        call = getattr(self._native, attr)
        if attr != self._name:
            return call

        def signalling(*args):
            out = call(*args)
            self._calls += 1
            if self._calls == self._at:
                os.kill(os.getpid(), signal.SIGINT)
            return out
        return signalling


def _interrupted(rank, world, where, ranks, path, error=KeyboardInterrupt):
    """Step 0 trains; step 1 is interrupted on `ranks` (where: in a block's
    forward, a backward hook (raising `error`), or a signal as one of stage
    3's native calls returns); the handler zeroes the grads and saves on
    every rank; step 2 trains."""
    model = make()
    model.blocks[1] = _Interrupting(model.blocks[1], where, 2 if rank in ranks else 0, error)
    engine = zerocore.wrap(model, sgd(model.parameters()), zerocore.Config(stage=3, timeout=20))
    caught, states = None, []
    for step in range(3):
        if step == 1 and rank in ranks and where not in ("forward", "backward hook"):
            engine.scheduler.native = _SignalAfter(engine.scheduler.native, where, 2 if "forward" in where else 1)
        x, y = lm_batch(step, 0, world)
        try:
            engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
            engine.step()
        except BaseException as e:  # noqa: BLE001 - the handler of a user's loop
            caught = (type(e).__name__, str(e))
            engine.zero_grad()
            engine.save(path)
        states.append(engine.full_state_dict())
    return caught, states


@pytest.mark.parametrize("where", ["forward", "backward hook", "pre_forward", "post_forward", "end_forward",
                                   "pre_backward", "post_backward", "end_backward"])
def test_ctrl_c_at_stage_3_comes_out_as_itself_and_the_engine_saves(where, tmp_path):
    """Every rank interrupted (as a Ctrl-C in a terminal interrupts every
    rank of the job), on 1 and 2 ranks; in the module's own code, only rank
    0 too (and, on both ranks, a BaseException of the user's own): its peer
    raises naming the failure, not waiting for it."""
    own = where in ("forward", "backward hook")
    cases = [(1, (0,), KeyboardInterrupt), (2, (0, 1), KeyboardInterrupt)] + \
        ([(2, (0,), KeyboardInterrupt), (2, (0, 1), _Stop)] if own else [])
    for world, ranks, error in cases:
        path = str(tmp_path / f"{world}-{len(ranks)}-{error.__name__}")
        results = run_ranks(_interrupted, world, where, ranks, path, error)
        for rank, (caught, states) in enumerate(results):
            what = f"{where}, {world} rank(s), rank {rank}, {error.__name__}"
            assert caught is not None, what
            if rank in ranks:
                assert caught[0] == error.__name__, (what, caught)
            else:
                assert caught[0] == "RuntimeError" and "other rank(s) failed during this" in caught[1], (what, caught)
            assert_state_close(states[1], states[0], rtol=0, atol=0, what=f"{what}: the interrupted step")
            assert_state_close(states[2], results[0][1][2], rtol=0, atol=0, what=f"{what}: the ranks agree")
            assert not torch.equal(states[2]["blocks.0.up.weight"], states[1]["blocks.0.up.weight"]), what
        model = make()
        model.blocks[1] = _Interrupting(model.blocks[1], where, 0)
        engine = zerocore.wrap(model, sgd(model.parameters()), zerocore.Config(stage=0))
        engine.load(path)
        assert_state_close(engine.full_state_dict(), results[0][1][1], rtol=0, atol=0, what=f"{where}: saved")


def _save_after_giving_up(rank, world, stage, path):
    model = make()
    engine = zerocore.wrap(model, sgd(model.parameters()), zerocore.Config(stage=stage))
    x, y = lm_batch(0, 0, world)
    engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    engine.zero_grad()
    engine.save(path)
    return engine.full_state_dict()


def test_save_after_a_step_given_up_with_zero_grad():
    """zero_grad() gives the step up: no grads are pending, so save works."""
    for stage in STAGES:
        with tempfile.TemporaryDirectory() as path:
            state = run_ranks(_save_after_giving_up, 2, stage, path)[0]
            model = make()
            engine = zerocore.wrap(model, sgd(model.parameters()), zerocore.Config(stage=0))
            engine.load(path)
            assert_state_close(engine.full_state_dict(), state, rtol=0, atol=0, what=f"stage {stage}")


# Training dtype, and the module's modes ------------------------------------------

def test_a_16_bit_model_wrapped_to_train_in_fp32_is_told_so():
    model = make().to(torch.bfloat16)
    with pytest.warns(UserWarning, match=r"params are torch.bfloat16 .* trains in torch.float32.*"
                                         r"pass Config\(dtype='bf16'\)"):
        zerocore.wrap(model, sgd(model.parameters()), zerocore.Config(stage=0))
    model = make().to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zerocore.wrap(model, sgd(model.parameters()), zerocore.Config(stage=0, dtype="bf16"))


def _cast_after_wrap(rank, world, stage):
    model = make()
    engine = zerocore.wrap(model, sgd(model.parameters()), zerocore.Config(stage=stage))
    before = engine.full_state_dict()
    x, y = lm_batch(0, 0, world)
    try:
        model.to(torch.bfloat16)
        engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    except RuntimeError as e:
        error = str(e)
    else:
        error = None
    return error, before, engine.close().state_dict()


def test_a_model_cast_after_wrap_raises_naming_config_dtype():
    """At stage 3 the cast itself raises (the params are released); at
    stages 0-2 the next forward does, before torch's dtype error in
    backward. engine.close() gives the fp32 params back, as trained."""
    for stage in STAGES:
        for error, before, closed in run_ranks(_cast_after_wrap, 2, stage):
            assert error is not None and "was cast to torch.bfloat16 after zerocore.wrap" in error, (stage, error)
            assert "model = engine.close()" in error and "Config(dtype='bf16')" in error, (stage, error)
            assert_state_close(closed, before, rtol=0, atol=0, what=f"stage {stage}: nothing lost")


def test_engine_train_and_eval_set_the_modules_mode_as_a_modules_do():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    engine = zerocore.wrap(model, sgd(model.parameters()), zerocore.Config(stage=0))
    x = torch.randn(4, 8)
    assert engine.eval() is engine and not engine.training and not any(m.training for m in model.modules())
    with torch.no_grad():
        assert torch.equal(engine(x), engine(x))  # no dropout
    assert engine.train() is engine and engine.training and all(m.training for m in model.modules())
    with torch.no_grad():
        assert not torch.equal(engine(x), engine(x))
    assert engine.train(False) is engine and not model[1].training
