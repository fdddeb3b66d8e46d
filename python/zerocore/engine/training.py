"""The engine's training loop (TrainingLoop): forward, backward, the step,
zero_grad and clip_grad_norm_, over the parts build.py builds, and what
changes from step to step (StepProgress).

forward runs the module (stage 3's hooks gather units as it goes);
backward runs autograd with the hooks that reduce grads (grad_reducer.py)
and, at stage 3, release and reduce units (stage3.py); the step is one
native call (ZeroStep) that reduces what is left, takes the global norm,
agrees across ranks, decides with the loss scaler, updates the partition
and gathers the params. The user's optimizer drives it: its step() and
zero_grad() are the engine's (optimizer_bridge.drive_engine).

torch.compile: the engine's own work runs eagerly, never traced
(torch.compiler.disable: dynamo must not trace native calls): the buffer
broadcast before the forward, backward, the step and zero_grad, and stage
3's hooks (stage3.py). The module's forward is compiled (in one graph at
stages 0-2, between the units' hooks at stage 3), and so is the backward of
what it compiled, through autograd as usual. (torch.compiler.disable imports
torch._dynamo with zerocore; building any torch.optim optimizer does too.)
"""
from __future__ import annotations

import dataclasses
import math

import torch

from zerocore import _native
from zerocore.runtime import interrupts
from zerocore.engine.build import EngineParts
from zerocore.engine.meeting import meet
from zerocore.ops.loss_scale import NonFiniteGradientError
from zerocore.comm.positions import engine_call
from zerocore.hooks.eager import UNIT_HOOKS
from zerocore.state.guards import dtype_changed

# Why a graph breaks at the engine's calls: dynamo's error under fullgraph=True.
_BUFFERS = ("zerocore: engine.forward broadcasts the module's buffers from rank 0 eagerly, a graph break before the "
            "module runs; for fullgraph=True compile the module (model.compile(fullgraph=True)), not the engine")
_TRAINING = ("zerocore: engine.backward, step and zero_grad run eagerly (native collectives and hooks), graph breaks; "
             "for fullgraph=True compile the forward alone (torch.compile(engine) or model.compile()) and call "
             "them outside it: the backward of the compiled forward is compiled all the same")
training_call = torch.compiler.disable(reason=_TRAINING)


@dataclasses.dataclass
class StepProgress:
    """Where training is: read by the engine's parts that need it (the
    positions engine_call notes, save and load)."""

    step_count: int = 0  # steps applied
    backward_calls: int = 0  # engine.backward calls since the last step or zero_grad
    grad_forwards: int = 0  # forwards with grad since then (meeting.meet)


class TrainingLoop:
    """The training loop over `parts`; it owns the per-step state."""

    def __init__(self, parts: EngineParts):
        self.parts = parts
        self.progress = StepProgress()
        self._forget_reduction()  # and clip_grad_norm_'s bound, the trainability changes noted

    # Forward ---------------------------------------------------------------
    @engine_call("forward", micro_batch=True)
    def forward(self, *args, **kwargs):
        """Engine.forward has the contract."""
        self.parts.compute_stream.follow()
        for p, name, dtype in self.parts.dtype_probes:
            if p.dtype != dtype:
                cast = p.dtype
                for g in self.parts.groups:
                    g.binder.undo_casts()
                raise dtype_changed(name, cast, dtype)
        # Compiled, a model without buffers has no graph break.
        buffers = next(self.parts.module.buffers(), None) is not None
        if torch.is_grad_enabled():  # one that raises, or has no backward, counts: the step's meeting compares them
            self.progress.grad_forwards += 1
        # The forward issues collectives: the ranks meet first (meeting.meet), at
        # stage 3 unless its last forward is still open on a peer (a forward
        # with no backward, as in evaluation), whose rounds this rank must answer.
        if self.parts.scheduler and not self.parts.scheduler.joining:
            self._meet_before_units()
        if buffers:
            self.sync_buffers(meet_first=not self.parts.scheduler)
        if self.parts.dtype != torch.float32:
            cast = lambda x: x.to(self.parts.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            args = torch.utils._pytree.tree_map(cast, args)
            kwargs = torch.utils._pytree.tree_map(cast, kwargs)
        failed = True
        try:
            out = self.parts.module(*args, **kwargs)
            failed = False
            return out
        finally:
            if self.parts.scheduler:
                self.parts.scheduler.end_forward(failed)

    @torch.compiler.disable(reason=UNIT_HOOKS)  # stage 3's forward breaks graphs at its units' hooks anyway
    def _meet_before_units(self):
        meet(self.parts.comm, "forward", self.progress)

    @torch.compiler.disable(reason=_BUFFERS)
    def sync_buffers(self, meet_first=False):
        """Every rank takes rank 0's buffers (running statistics...), as DDP
        does; meet_first: the ranks meet first (meeting.meet), where nothing else has."""
        if meet_first:
            meet(self.parts.comm, "forward", self.progress)
        for b in self.parts.module.buffers():
            self.parts.comm.broadcast(b)

    # Backward --------------------------------------------------------------
    @training_call
    @engine_call("backward", micro_batch=True)
    def backward(self, loss: torch.Tensor):
        """Engine.backward has the contract."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward: loss must be a scalar tensor")
        self.parts.compute_stream.check("engine.backward")
        placement = self.parts.placement
        if placement.partitions_grads and getattr(torch._dynamo.compiled_autograd, "compiled_autograd_enabled", False):
            hooks = "hand each grad to native reduction" + (" and gather units" if self.parts.scheduler else "")
            raise RuntimeError(
                f"engine.backward: compiled autograd cannot run the backward of stage {placement.stage}, whose "
                f"hooks {hooks} as autograd goes, outside any graph. Leave compiled autograd off "
                "(torch._dynamo.config.compiled_autograd = False) for engine.backward: the backward of a compiled "
                "forward is compiled all the same")
        if self.parts.zero_step.exchanged:
            raise RuntimeError("engine.backward: the grads of this step were already reduced (engine.clip_grad_norm_ "
                               "or a step that raised); call engine.step() or engine.zero_grad() first")
        if placement.partitions_grads and not self.parts.scheduler:  # its reductions are collectives
            meet(self.parts.comm, "backward", self.progress)
        self._note_trainability()
        self.parts.reducer.before_backward()
        if self.parts.scheduler:
            self.parts.scheduler.begin_backward()
        failed = True
        try:
            (loss * self.parts.scaler.scale if self.parts.scaler.enabled else loss).backward()
            failed = False
        finally:
            try:
                if self.parts.scheduler:  # first: its last round reduces the units' grads not reduced yet
                    self.parts.scheduler.end_backward(failed)
            finally:
                self.parts.reducer.after_backward()
        if self.parts.exact:
            self.parts.exact.add_micro_batch()
        self.progress.backward_calls += 1
        for g in self.parts.groups:
            if g.trainable:
                g.binder.hide_grads()

    # Step ------------------------------------------------------------------
    @training_call
    @engine_call("clip_grad_norm_()")
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Engine.clip_grad_norm_ has the contract."""
        if norm_type != 2.0:
            raise ValueError(f"engine.clip_grad_norm_: norm_type={norm_type!r}; zerocore clips by the L2 norm "
                             "(norm_type=2.0)")
        if not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"engine.clip_grad_norm_: max_norm={max_norm!r}; use a positive number")
        self.parts.compute_stream.check("engine.clip_grad_norm_")
        total = self._reduce_grads()
        if self.parts.exact:  # the exact mean's, the same at any world size
            norm = math.sqrt(self.parts.exact.squares) / self.parts.scaler.scale
        else:
            norm = math.sqrt(total) / (self.parts.comm.world_size * self.parts.scaler.scale)
        self._clip_norm = max_norm if self._clip_norm is None else min(self._clip_norm, max_norm)
        return torch.tensor(norm, device=self.parts.device)

    def _reduce_grads(self) -> float:
        """Reduces this step's grads across ranks, once a step, and returns
        their global sum of squares (of loss-scaled grads summed over ranks);
        raises if a param was frozen or unfrozen on any rank."""
        self._check_grads()
        total, changes = self._agreeing(lambda: self.parts.zero_step.exchange(len(self._trainability_changed)))
        if changes:
            self._refuse_trainability_change()
        return total

    def _check_grads(self):
        if self.progress.backward_calls == 0:
            raise RuntimeError("engine.step: no gradients; call engine.backward(loss) first")

    def _agreeing(self, call):
        """A native call of the step: its refusals (ranks that issued
        different collectives, a param frozen or unfrozen on some rank)
        become the errors that name what differed, on every rank."""
        parts = self.parts
        if not parts.zero_step.exchanged:  # this call takes the grads
            if parts.scheduler and parts.scheduler.joining:  # a forward with no backward since
                parts.scheduler.close_passes()
            meet(parts.comm, "step", self.progress)
            parts.update.count_grads(self.progress.backward_calls)
            if parts.exact:
                if not parts.placement.partitions_grads:  # stages 0-1: the int64 sums, not the grads, reduced
                    parts.reducer.collectives.run()
                # As many backwards on every rank (meeting.meet); stages 2-3's late grads reduced into the sums first.
                parts.exact.reduce(self.progress.backward_calls * parts.comm.world_size,
                                   parts.reducer.native if parts.placement.partitions_grads else None)
        try:
            return call()
        except _native.CollectiveOrderDiverged as e:
            trace = e.args[1]
        except _native.TrainabilityChanged:
            trace = None
        finally:
            self.parts.update.follow_swaps()
        if trace is None:
            self._refuse_trainability_change()
        raise self.parts.comm.order_error(trace)

    def _note_trainability(self):
        """Notes params whose requires_grad differs from the plan made at
        wrap; the step refuses them on every rank (_refuse_trainability_change)."""
        for p, trainable, name in self.parts.planned_trainable:
            if p.requires_grad != trainable:
                self._trainability_changed.add(name)

    def _refuse_trainability_change(self):
        """A param was frozen or unfrozen after wrap, on some rank: every
        rank raises before anything is updated. The engine laid out and
        partitioned the trainable params at wrap, so it cannot train a param
        unfrozen since (its grads go nowhere) nor leave one frozen since as
        torch would (it would still get weight decay and moment updates)."""
        mine = sorted(self._trainability_changed)
        for p, trainable, _ in self.parts.planned_trainable:
            if not trainable:
                p.grad = None  # grads autograd made for a frozen param unfrozen since
        here = (f"{', '.join(mine[:5])}{' and more' if len(mine) > 5 else ''} changed requires_grad" if mine
                else "another rank changed requires_grad of some params")
        raise RuntimeError(
            f"zerocore: {here} after zerocore.wrap; the engine plans which params train when it wraps the model, "
            "so this step would not train them as torch would. Nothing was updated. To change which params "
            "train: model = engine.close() (the trained params), set requires_grad, and wrap the model again "
            "(the optimizer's moments start afresh); or, to unfreeze a layer later without that, keep it "
            "trainable from the start in a param group of its own with lr=0 until it should train (a scheduler "
            "can raise it).")

    @training_call
    @engine_call("step()")
    def step(self) -> bool:
        """The step the user's optimizer.step() runs (optimizer_bridge):
        applies this step's grads; False when an fp16 overflow on any rank
        skipped it (on every rank)."""
        self.parts.compute_stream.check("engine.step")
        self._check_grads()
        bounds = [b for b in (self.parts.config.max_grad_norm, self._clip_norm) if b is not None]
        self._carry_param_writes()
        # A Ctrl-C during the native step comes out after the engine counted
        # the update it applied and released what it must (interrupts.py).
        with interrupts.deferred():
            try:
                applied, _, _ = self._agreeing(lambda: self.parts.zero_step.step(
                    self.parts.kind, self.parts.optimizer.param_groups, step=self.progress.step_count + 1,
                    max_norm=min(bounds) if bounds else None, changes=len(self._trainability_changed),
                    **self._exact_options()))
            except NonFiniteGradientError:  # nothing was updated; a pending offload update lands
                self._count_refused()
                self.finish_update()
                raise
            self.progress.step_count += applied
            self._end_step()
        return applied

    def _exact_options(self) -> dict:
        """Config(deterministic=True): the exact sum's numbers, which the
        native step takes instead of the exchange's (called once they are)."""
        if not self.parts.exact:
            return {}
        return {"exact_sum_of_squares": self.parts.exact.squares, "regrid": self.parts.exact.regrid}

    def finish_update(self):
        """Engine.finish_update has the contract."""
        self._carry_param_writes()
        try:  # a step the device refused and no exchange has named yet (ZeroStep.settle)
            self.parts.zero_step.settle()
        except NonFiniteGradientError:
            self._count_refused()
            raise
        if self.parts.scheduler and self.parts.placement.optimizer_on_host and self.parts.update.pending:
            # Stage 3's end of step gathered the next forward's first units
            # from the shards the params up replace: they go (their gathers
            # done), and the next forward gathers the new params.
            self.parts.scheduler.free_all()
        if self.parts.update.params_up() and self.parts.param_gather:
            self.parts.param_gather.run()

    def _count_refused(self):
        """The native step refused a step and every one after it (decided
        on the device, a refusal is found a step or more later): the step
        count goes back to the last step applied."""
        self.progress.step_count = self.parts.zero_step.refused_step - 1

    def _carry_param_writes(self):
        for g in self.parts.groups:
            g.binder.carry_param_writes()

    def _end_step(self):
        self._forget_reduction()
        if self.parts.scheduler:
            self.parts.scheduler.end_step()

    @training_call
    def zero_grad(self):
        """Engine.zero_grad has the contract."""
        self.parts.comm.failure.check()
        for g in self.parts.groups:
            g.binder.zero_grad()
        self.parts.reducer.drop_staged()
        self._forget_reduction()

    def _forget_reduction(self):
        """A new step begins: nothing of the last one's reduction applies,
        and no backward of it counts (save, meeting.meet)."""
        self.progress.backward_calls = 0
        self.progress.grad_forwards = 0  # forwards with grad since the last step or zero_grad (meeting.meet)
        self.parts.compute_stream.end_step()
        self._clip_norm = None
        self.parts.zero_step.forget()
        if self.parts.exact:
            self.parts.exact.end_step()
        self._trainability_changed = set()  # names of this rank's params whose requires_grad changed
