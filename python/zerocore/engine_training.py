"""The engine's training loop: forward, backward, step, zero_grad and
clip_grad_norm_, over the parts engine.py builds.

forward runs the module (stage 3's hooks gather units as it goes);
backward runs autograd with the hooks that reduce grads (hooks/grad_reducer.py)
and, at stage 3, release and reduce units (hooks/stage3.py); the step is one
native call (ZeroStep) that reduces what is left, takes the global norm,
agrees across ranks, decides with the loss scaler, updates the partition
and gathers the params. The user's optimizer drives it: its step() and
zero_grad() are the engine's (optim.drive_engine).

torch.compile: the engine's own work runs eagerly, never traced
(torch.compiler.disable: dynamo must not trace native calls): the buffer
broadcast before the forward, backward, the step and zero_grad, and stage
3's hooks (hooks/stage3.py). The module's forward is compiled (in one graph at
stages 0-2, between the units' hooks at stage 3), and so is the backward of
what it compiled, through autograd as usual. (torch.compiler.disable imports
torch._dynamo with zerocore; building any torch.optim optimizer does too.)
"""
from __future__ import annotations

import math

import torch

from zerocore import _native
from zerocore.runtime import interrupts
from zerocore.comm.communicator import MICRO_BATCHES, CollectiveOrderError
from zerocore.ops.loss_scale import NonFiniteGradientError
from zerocore.param_guards import dtype_changed
from zerocore.comm.positions import engine_call
from zerocore.hooks.eager import UNIT_HOOKS

# Why a graph breaks at the engine's calls: dynamo's error under fullgraph=True.
_BUFFERS = ("zerocore: engine.forward broadcasts the module's buffers from rank 0 eagerly, a graph break before the "
            "module runs; for fullgraph=True compile the module (model.compile(fullgraph=True)), not the engine")
_TRAINING = ("zerocore: engine.backward, step and zero_grad run eagerly (native collectives and hooks), graph breaks; "
             "for fullgraph=True compile the forward alone (torch.compile(engine) or model.compile()) and call "
             "them outside it: the backward of the compiled forward is compiled all the same")
_training = torch.compiler.disable(reason=_TRAINING)
# Where a rank is in its step, for _meet: before a micro-batch's forward or backward, or at the step.
_PLACES = ("forward", "backward", "step")


class Training:
    """Engine's training methods (engine.py holds what they run on)."""

    # Forward ---------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    @engine_call("forward", micro_batch=True)
    def forward(self, *args, **kwargs):
        """Runs the module. Floating-point inputs are cast to the training
        dtype; buffers come from rank 0, as DDP does."""
        self.compute_stream.follow()
        for p, name, dtype in self._dtype_probes:
            if p.dtype != dtype:
                cast = p.dtype
                for g in self.groups:
                    g.undo_casts()
                raise dtype_changed(name, cast, dtype)
        buffers = next(self.module.buffers(), None) is not None  # compiled, a model without them has no graph break
        if torch.is_grad_enabled():  # one that raises, or has no backward, counts: the step's meeting compares them
            self._grad_forwards += 1
        # The forward issues collectives: the ranks meet first (_meet), at
        # stage 3 unless its last forward is still open on a peer (a forward
        # with no backward, as in evaluation), whose rounds this rank must answer.
        if self.scheduler and not self.scheduler.joining:
            self._meet_before_units()
        if buffers:
            self._sync_buffers(meet=not self.scheduler)
        if self.dtype != torch.float32:
            cast = lambda x: x.to(self.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            args = torch.utils._pytree.tree_map(cast, args)
            kwargs = torch.utils._pytree.tree_map(cast, kwargs)
        failed = True
        try:
            out = self.module(*args, **kwargs)
            failed = False
            return out
        finally:
            if self.scheduler:
                self.scheduler.end_forward(failed)

    # Modes -----------------------------------------------------------------
    def train(self, mode: bool = True):
        """As nn.Module.train(mode): the module's training mode (dropout,
        batch norm's statistics); returns the engine."""
        self.module.train(mode)
        return self

    def eval(self):
        """As nn.Module.eval(): the module in evaluation mode, until
        engine.train(); returns the engine."""
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.module.training

    @torch.compiler.disable(reason=UNIT_HOOKS)  # stage 3's forward breaks graphs at its units' hooks anyway
    def _meet_before_units(self):
        self._meet("forward")

    def _meet(self, place: str):
        """Every rank at the same place of its step (_PLACES), or every
        rank raises CollectiveOrderError naming each one's: a rank that runs
        more micro-batches than another would otherwise wait, until the
        timeout, in a collective its peers never issue (stage 3's rounds,
        stage 2's reduce-scatters, a buffer broadcast) while they wait in the
        step's. The ranks meet before each forward and backward that issues
        collectives and at the step's exchange (one small control collective
        each), so the first place where they part is a meeting. At stage 3
        the forward meets (its rounds are a micro-batch's first
        collectives), not the backward, which begins by answering the rounds
        of peers still in their forward: a rank must not wait in a meeting
        while a peer may wait for its answers (UnitScheduler.joining), so a
        forward right after a forward with no backward (evaluation) does not
        meet, and the step closes stage 3's passes before meeting."""
        if self.comm.world_size == 1:
            return
        micro_batch = self._backward_calls + (place != "step")  # the one about to run; at the step, how many ran
        # At the step, the forwards with grad too: one that raised on a rank whose loop skipped its batch, or
        # whose backward never ran, leaves that rank a forward ahead, which pairing steps would hide.
        forwards = self._grad_forwards if place == "step" else 0
        mine = (len(_PLACES) * micro_batch + _PLACES.index(place)) << 32 | forwards
        # A host number: the meeting waits for no device work (on CUDA the host runs on ahead of the GPU).
        places = [(*divmod(v >> 32, len(_PLACES)), v & 0xFFFFFFFF)
                  for v in self.comm.gather_ints(mine, MICRO_BATCHES, after_compute=False)]
        if len(set(places)) == 1:
            return

        def at(n, p, f):
            if _PLACES[p] != "step":
                return f"at the {_PLACES[p]} of micro-batch {n}"
            return (f"at the step after {n} micro-batch(es) (engine.backward calls) and {f} forward(s) with grad"
                    + (f" ({f - n} raised, or had no engine.backward)" if f > n else ""))
        ranks = "\n".join(f"  rank {r}: {at(*place)}" for r, place in enumerate(places))
        raise CollectiveOrderError(
            f"zerocore: the ranks ran different numbers of micro-batches in this step:\n{ranks}\nEvery rank must "
            "run as many forwards and engine.backward calls between steps as every other: give each rank as many "
            "batches (DistributedSampler(drop_last=True), or stop every rank at the count of the one with "
            "fewest), and where a forward, a backward or your code between them raises on one rank and your loop "
            "skips the batch, call engine.zero_grad() on that rank before the next batch and on every rank after "
            "this error. Nothing was updated; engine.zero_grad() on every rank drops this step's grads, and "
            "training can go on.")

    @torch.compiler.disable(reason=_BUFFERS)
    def _sync_buffers(self, meet=False):
        """Every rank takes rank 0's buffers (running statistics...), as DDP
        does; meet: the ranks meet first (_meet), where nothing else has."""
        if meet:
            self._meet("forward")
        for b in self.module.buffers():
            self.comm.broadcast(b)

    # Backward --------------------------------------------------------------
    @_training
    @engine_call("backward", micro_batch=True)
    def backward(self, loss: torch.Tensor):
        """loss.backward() with gradient reduction. Call it k times before
        step() to accumulate: grads sum over calls and average over ranks."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward: loss must be a scalar tensor")
        self.compute_stream.check("engine.backward")
        if self.placement.partitions_grads and getattr(torch._dynamo.compiled_autograd, "compiled_autograd_enabled",
                                                       False):
            hooks = "hand each grad to native reduction" + (" and gather units" if self.scheduler else "")
            raise RuntimeError(
                f"engine.backward: compiled autograd cannot run the backward of stage {self.placement.stage}, whose "
                f"hooks {hooks} as autograd goes, outside any graph. Leave compiled autograd off "
                "(torch._dynamo.config.compiled_autograd = False) for engine.backward: the backward of a compiled "
                "forward is compiled all the same")
        if self.zero_step.exchanged:
            raise RuntimeError("engine.backward: the grads of this step were already reduced (engine.clip_grad_norm_ "
                               "or a step that raised); call engine.step() or engine.zero_grad() first")
        if self.placement.partitions_grads and not self.scheduler:  # its reductions are collectives
            self._meet("backward")
        self._note_trainability()
        self.reducer.before_backward()
        if self.scheduler:
            self.scheduler.begin_backward()
        failed = True
        try:
            (loss * self.scaler.scale if self.scaler.enabled else loss).backward()
            failed = False
        finally:
            try:
                if self.scheduler:  # first: its last round reduces the units' grads not reduced yet
                    self.scheduler.end_backward(failed)
            finally:
                self.reducer.after_backward()
        if self.exact:
            self.exact.add_micro_batch()
        self._backward_calls += 1
        for g in self.groups:
            if g.trainable:
                g.hide_grads()

    def _attach_unit_grads(self, unit):
        """Stage 3, before a unit's backward (UnitScheduler's
        on_unit_backward): its trainable groups' grads become views into
        gradient reduction's staging."""
        for g in unit.groups:
            if g.trainable:
                self.reducer.attach_grad_views(g)

    # Step ------------------------------------------------------------------
    @_training
    def step(self) -> bool:
        """Applies the accumulated gradients. Returns False when an fp16
        overflow on any rank skipped the step (on every rank)."""
        return self.optimizer.step()

    @_training
    @engine_call("clip_grad_norm_()")
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips this step's grads to the global norm max_norm, as
        torch.nn.utils.clip_grad_norm_ does, and returns their global norm
        (over every param and rank, before clipping; inf or NaN when a grad
        is). Call it on every rank, between the last engine.backward() of a
        step and engine.step(), which applies the clipped grads. With
        Config(max_grad_norm) too, the smaller bound wins."""
        if norm_type != 2.0:
            raise ValueError(f"engine.clip_grad_norm_: norm_type={norm_type!r}; zerocore clips by the L2 norm "
                             "(norm_type=2.0)")
        if not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"engine.clip_grad_norm_: max_norm={max_norm!r}; use a positive number")
        self.compute_stream.check("engine.clip_grad_norm_")
        total = self._reduce_grads()
        if self.exact:  # the exact mean's, the same at any world size
            norm = math.sqrt(self.exact.squares) / self.scaler.scale
        else:
            norm = math.sqrt(total) / (self.comm.world_size * self.scaler.scale)
        self._clip_norm = max_norm if self._clip_norm is None else min(self._clip_norm, max_norm)
        return torch.tensor(norm, device=self.device)

    def _reduce_grads(self) -> float:
        """Reduces this step's grads across ranks, once a step, and returns
        their global sum of squares (of loss-scaled grads summed over ranks);
        raises if a param was frozen or unfrozen on any rank."""
        self._check_grads()
        total, changes = self._agreeing(lambda: self.zero_step.exchange(len(self._trainability_changed)))
        if changes:
            self._refuse_trainability_change()
        return total

    def _check_grads(self):
        if self._backward_calls == 0:
            raise RuntimeError("engine.step: no gradients; call engine.backward(loss) first")

    def _agreeing(self, call):
        """A native call of the step: its refusals (ranks that issued
        different collectives, a param frozen or unfrozen on some rank)
        become the errors that name what differed, on every rank."""
        if not self.zero_step.exchanged:  # this call takes the grads
            if self.scheduler and self.scheduler.joining:  # a forward with no backward since
                self.scheduler.close_passes()
            self._meet("step")
            self.update.count_grads(self._backward_calls)
            if self.exact:
                if not self.placement.partitions_grads:  # stages 0-1: the int64 sums, not the grads, reduced
                    self.reducer.collectives.run()
                # As many backwards on every rank (_meet); stages 2-3's late grads reduced into the sums first.
                self.exact.reduce(self._backward_calls * self.comm.world_size,
                                  self.reducer.native if self.placement.partitions_grads else None)
        try:
            return call()
        except _native.CollectiveOrderDiverged as e:
            trace = e.args[1]
        except _native.TrainabilityChanged:
            trace = None
        finally:
            self.update.follow_swaps()
        if trace is None:
            self._refuse_trainability_change()
        raise self.comm.order_error(trace)

    def _note_trainability(self):
        """Notes params whose requires_grad differs from the plan made at
        wrap; the step refuses them on every rank (_refuse_trainability_change)."""
        for p, trainable, name in self._planned_trainable:
            if p.requires_grad != trainable:
                self._trainability_changed.add(name)

    def _refuse_trainability_change(self):
        """A param was frozen or unfrozen after wrap, on some rank: every
        rank raises before anything is updated. The engine laid out and
        partitioned the trainable params at wrap, so it cannot train a param
        unfrozen since (its grads go nowhere) nor leave one frozen since as
        torch would (it would still get weight decay and moment updates)."""
        mine = sorted(self._trainability_changed)
        for p, trainable, _ in self._planned_trainable:
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

    @_training
    @engine_call("step()")
    def _step(self) -> bool:
        self.compute_stream.check("engine.step")
        self._check_grads()
        bounds = [b for b in (self.config.max_grad_norm, self._clip_norm) if b is not None]
        self._carry_param_writes()
        # A Ctrl-C during the native step comes out after the engine counted
        # the update it applied and released what it must (runtime/interrupts.py).
        with interrupts.deferred():
            try:
                applied, _, _ = self._agreeing(lambda: self.zero_step.step(
                    self.kind, self.optimizer.param_groups, step=self.step_count + 1,
                    max_norm=min(bounds) if bounds else None, changes=len(self._trainability_changed),
                    **self._exact_options()))
            except NonFiniteGradientError:  # nothing was updated; a pending offload update lands
                self._count_refused()
                self.finish_update()
                raise
            self.step_count += applied
            self._end_step()
        return applied

    def _exact_options(self) -> dict:
        """Config(deterministic=True): the exact sum's numbers, which the
        native step takes instead of the exchange's (called once they are)."""
        if not self.exact:
            return {}
        return {"exact_sum_of_squares": self.exact.squares, "regrid": self.exact.regrid}

    def finish_update(self):
        """Offload with a delayed update: the update still running on the
        host finishes and its params go up (and, in stages 1-2, to every
        rank), so the module and the engine hold the latest params. Reading
        or saving the model calls it first; nothing to do otherwise. Call
        it on every rank. Before it, writes the user made to params held
        whole reach the fp32 masters (FlatGroup.carry_param_writes), and the
        device's verdicts not read yet are (a step it refused raises
        NonFiniteGradientError here, on every rank)."""
        self._carry_param_writes()
        try:  # a step the device refused and no exchange has named yet (ZeroStep.settle)
            self.zero_step.settle()
        except NonFiniteGradientError:
            self._count_refused()
            raise
        if self.scheduler and self.placement.optimizer_on_host and self.update.pending:
            # Stage 3's end of step gathered the next forward's first units
            # from the shards the params up replace: they go (their gathers
            # done), and the next forward gathers the new params.
            self.scheduler.free_all()
        if self.update.params_up() and self.param_gather:
            self.param_gather.run()

    def _count_refused(self):
        """The native step refused a step and every one after it (decided
        on the device, a refusal is found a step or more later): the step
        count goes back to the last step applied."""
        self.step_count = self.zero_step.refused_step - 1

    def _carry_param_writes(self):
        for g in self.groups:
            g.carry_param_writes()

    def _end_step(self):
        self._forget_reduction()
        if self.scheduler:
            self.scheduler.end_step()

    @_training
    def zero_grad(self):
        """Zeroes the grads (a step's reduced ones too, after a step that
        raised); every param's .grad is None. After a failed collective it
        refuses, as every call does (positions.engine_call)."""
        self.comm.failure.check()
        for g in self.groups:
            g.zero_grad()
        self.reducer.drop_staged()
        self._forget_reduction()

    def _forget_reduction(self):
        """A new step begins: nothing of the last one's reduction applies,
        and no backward of it counts (save, _meet)."""
        self._backward_calls = 0
        self._grad_forwards = 0  # forwards with grad since the last step or zero_grad (_meet)
        self.compute_stream.end_step()
        self._clip_norm = None
        self.zero_step.forget()
        if self.exact:
            self.exact.end_step()
        self._trainability_changed = set()  # names of this rank's params whose requires_grad changed
