"""Stage 3: parameters live as shards; a unit's params are gathered just
before the unit runs (forward, and again in backward) and released after.
The schedule itself is native (zerocore._native.UnitSchedule: which unit is
gathered in which buffer of the fixed gather pool, prefetch, release, when
a unit's grads are reduced); this
module holds only what must be Python: the module and autograd hooks that
tell it what happened, the binding of each unit's nn.Parameters to the
buffer it is gathered in, and the saved-tensor hooks that keep what
autograd saved pointing at the right bytes. Each hook is one native call,
which returns what to bind and what to release (the schedule knows what
the params view), and declares the compute stream's reads of the unit's
params to the backend, so the checking backend orders them against the
gathers.

A unit (state/units.py) is a module whose params are gathered together.

Ranks may run different units, a different number of times (experts chosen
by the data): every hook that needs params posts a round of the native
schedule, in which the ranks agree on what to gather and when to reduce
(unit_schedule.h says how). The hooks only report:
- forward: a unit's pre-hook needs it, and says whether it routed the
  inputs that need grads through _PostBackward (to find its post-backward
  point); its post-hook says it is done and whether its outputs need
  grads, which it then hooks so that backward needs the unit again before
  its grads are computed; the unit is released then. The root's post-hook
  ends the forward: its done-round goes out, and what comes next waits,
  if it must, until every rank's forward has ended;
- backward: a unit is released at its post-backward point, when the grads of
  its inputs are complete: every param its backward reads (frozen weights
  that input grads need included) has been read by then. A unit whose
  inputs need no grad (the first one) stays until backward ends.
Prefetch is only ever a guess: a wrong one costs a gather, never a wrong
result, and every rank makes the same guesses.

torch.compile: the hooks run eagerly (hooks/eager.py).

Each hook's native call and the binding that mirrors what it did happen
under interrupts.deferred(): a Ctrl-C between them would leave the params of
a unit the schedule bound pointing at placeholders (runtime/interrupts.py).

Saved tensors: views of gathered params are packed and unpacked by
SavedParamViews (hooks/saved_param_views.py).
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

import zerocore
from zerocore.runtime import interrupts
from zerocore.flat_group import NATIVE_NAMES
from zerocore.hooks.eager import eager
from zerocore.hooks.grad_reducer import outside_engine_backward
from zerocore.hooks.saved_param_views import SavedParamViews


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs. Its backward runs once the grads of all
    of them are complete, from inside the unit only: the unit's
    post-backward point (FSDP2 marks it the same way). A tensor hook on the
    inputs would wait for their uses outside the unit too."""

    @staticmethod
    def forward(ctx, hook, *inputs):
        ctx.hook = hook
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook()
        return (None, *grads)


class UnitScheduler:
    def __init__(self, units, schedule, backend, on_unit_backward=None):
        self.units = units
        self.native = schedule
        self.backend = backend  # the schedule's (its queues'): gather_all's buffers come from it
        for u in units:  # asked once: a hook then binds without calling back into the schedule
            u.schedule = schedule
            u.elems = schedule.unit_elems(u.index)
            starts = [schedule.group_offset(u.index, i) for i in range(len(u.groups))]
            u.spans = [(start, start + g.plan.total_elems) for start, g in zip(starts, u.groups)]
        self.on_unit_backward = on_unit_backward or (lambda unit: None)
        self.in_backward = False
        # What the native schedule handed back (each hook is one call that
        # returns what to bind and release): unit index -> address of the
        # buffer its params view, and address -> the unit bound there (for
        # saved tensors).
        self.bound = {}
        self.at = {}
        self.flats = {}  # (address, elements) -> a torch view of a buffer (pool buffers live as long as the engine)
        self.saved_views = SavedParamViews(self)
        self.saving = False  # saved_views is on: from the root's forward pre-hook to its post-hook
        # A coalesced unit in its forward: (unit, position of the last of its
        # modules whose forward ended, that module's output), or None.
        self.open_run = None
        # This rank's forward ended with no hook since (end_forward): its
        # peers may still need its answers in their forward's rounds, which
        # the next hook, backward or step gives, so nothing may wait for
        # them before that (Training._meet).
        self.joining = False
        self.handles = []
        for u in units:
            for position, m in enumerate(u.modules):
                self.handles.append(m.register_forward_pre_hook(self._pre_forward(u, position), with_kwargs=True))
                self.handles.append(m.register_forward_hook(self._post_forward(u, position)))

    # Binding ---------------------------------------------------------------
    def _flat(self, address, unit, buffer) -> torch.Tensor:
        key = (address, unit.elems)  # units of different sizes share a pool slot
        flat = self.flats.get(key)
        if flat is None:
            flat = self.flats[key] = zerocore.to_torch(buffer)
        return flat

    def _apply(self, unit, binding):
        """Takes what a hook of `unit` returned: (bind, released). The
        released units' params point at placeholders; `unit`'s view the
        buffer in bind = (address, buffer), unless they view it already."""
        bind, released = binding
        self._unbind(released)
        if bind is not None:
            address, buffer = bind
            flat = self._flat(address, unit, buffer)
            for g, (start, end) in zip(unit.groups, unit.spans):
                g.bind(flat[start:end])
            self.bound[unit.index] = address
            self.at[address] = unit

    def _unbind(self, released):
        """Points the params of units the schedule released at placeholders."""
        for index in released:
            unit = self.units[index]
            for g in unit.groups:
                g.unbind()
            address = self.bound.pop(index)
            if self.at.get(address) is unit:
                del self.at[address]

    def _unbind_released(self):
        """After a call that may release many units (the end of a pass, the
        step) or that raised."""
        self._unbind(self.native.take_released())

    def buffer_of(self, unit) -> torch.Tensor:
        """The torch view of the buffer `unit` is gathered in (backward's
        unpacking of saved views): the one its params view, or, for a unit
        not bound (unpacked outside its own backward), the schedule's."""
        address = self.bound.get(unit.index)
        if address is not None:
            return self.flats[(address, unit.elems)]
        buffer = self.native.read(unit.index)
        if buffer is None:
            raise RuntimeError(f"zerocore: backward needs params of unit {unit.index} "
                               f"({type(unit.modules[0]).__name__}), which is not gathered; was the graph of an "
                               "earlier step kept (retain_graph) past engine.step()?")
        return self._flat(buffer.data_ptr, unit, buffer)

    # Forward ---------------------------------------------------------------
    # A coalesced unit is one unit to the schedule: its first module's
    # pre-hook opens its forward and its last module's post-hook ends it, the
    # modules between only running. Anything else that happens before the
    # run ends (another unit's hook, a module of the run out of its order, a
    # recomputation in backward, which runs one module) ends it there, so
    # the schedule sees every forward call opened and ended once.
    def _pre_forward(self, unit, position):
        @eager
        def hook(module, args, kwargs):
            run = self.open_run
            if run is not None and run[0] is unit and position == run[1] + 1:
                return None  # the next module of the open run: its params are bound
            self._end_run()
            if unit.index == 0 and not self.in_backward:
                self._save_param_views(True)
            flat, spec = tree_flatten((args, kwargs))
            need = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            marks = bool(need) and torch.is_grad_enabled()
            self.joining = False  # the call ends the join (or fails with the pass)
            with interrupts.deferred():
                self._apply(unit, self.native.pre_forward(unit.index, marks))
            if len(unit.modules) > 1:
                self.open_run = (unit, position - 1, None)
            if not marks:
                return None
            # Its inputs go through _PostBackward, to find its post-backward
            # point. Under no_grad (reentrant checkpointing's first pass)
            # nothing is recorded; its recomputation in backward records it.
            marked = _PostBackward.apply(self._post_backward(unit), *(flat[i] for i in need))
            for i, t in zip(need, marked):
                flat[i] = t
            return tree_unflatten(flat, spec)
        return hook

    def _save_param_views(self, on: bool):
        """The root's forward runs under saved_views, whether the engine or
        the user calls the module."""
        if on and not self.saving:
            self.saved_views.__enter__()
        elif self.saving and not on:
            self.saved_views.__exit__(None, None, None)
        self.saving = on

    def _post_forward(self, unit, position):
        @eager
        def hook(module, args, output):
            run = self.open_run
            if run is not None and run[0] is unit:
                self.open_run = (unit, position, output)
                if position < len(unit.modules) - 1 and not self.in_backward:
                    return output  # the run goes on
            self._end_run()
            if len(unit.modules) == 1:
                self._end_forward_call(unit, output)
            return output
        return hook

    def _end_run(self):
        """Ends the open coalesced unit's forward call at the output of its
        module that ran last."""
        if self.open_run is not None:
            unit, _, output = self.open_run
            self.open_run = None
            self._end_forward_call(unit, output)

    def _end_forward_call(self, unit, output):
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors and not self.in_backward:  # a recomputation's backward is the one already running
            torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward(unit), mode="any")
        with interrupts.deferred():
            self._apply(unit, self.native.post_forward(unit.index, bool(tensors)))
        if unit.index == 0 and not self.in_backward:  # the end of the forward, however it was called
            self.end_forward()

    @eager
    def end_forward(self, failed=False):
        """After the root's forward (or its failure): posts this rank's
        done-round (a failure waits for the other ranks to hear of it)."""
        self.open_run = None  # a forward that raised inside a coalesced unit: the schedule releases it
        self._save_param_views(False)
        self.joining = False
        with interrupts.deferred():
            try:
                self.native.end_forward(failed)
            finally:
                self._unbind_released()
        self.joining = not failed

    # Backward --------------------------------------------------------------
    def begin_backward(self):
        """Raises (PeerFailed) if another rank's forward failed."""
        self.joining = False
        self.native.begin_backward()
        self.in_backward = True

    def _pre_backward(self, unit):
        def hook(_grad):
            if not self.in_backward:
                raise outside_engine_backward()
            self.joining = False
            with interrupts.deferred():  # the unit's grad views mirror the reducer's staging too
                self._apply(unit, self.native.pre_backward(unit.index))
                self.on_unit_backward(unit)
        return hook

    def _post_backward(self, unit):
        def hook():
            with interrupts.deferred():
                self._apply(unit, self.native.post_backward(unit.index))
        return hook

    def end_backward(self, failed=False):
        """Rounds until every rank's backward is over; the last one reduces
        the grads of every unit not reduced yet and releases every unit."""
        with interrupts.deferred():
            try:
                self.native.end_backward(failed)
            finally:
                self._unbind_released()
                self.in_backward = False

    def end_step(self):
        """Called once per optimizer step, after the native step ran the
        schedule's end-of-step round (ZeroStep: this step's order guides the
        next, the units it updated are released): their params unbind."""
        self.joining = False
        self._unbind_released()

    def close_passes(self):
        """Before the step's first collective (Training._meet): a forward
        this rank ended is over on every rank, as the step's own exchange
        would make it first (UnitSchedule::release_all), so no peer still
        waits for this rank's rounds; what it releases unbinds."""
        self.joining = False
        with interrupts.deferred():
            try:
                self.native.release_all()
            finally:
                self._unbind_released()

    # Whole-model views -----------------------------------------------------
    def gather_all(self):
        """Every unit into a temporary buffer of its own, outside the pool
        (gathered_params; not counted as training traffic), device memory of
        the schedule's backend, freed once the params unbind (free_all)."""
        for u in (u for u in self.units if u.groups):
            dtype = u.groups[0].dtype
            buffer = self.backend.allocate("device", u.elems * dtype.itemsize, f"unit {u.index} gathered whole") \
                .view(0, NATIVE_NAMES[dtype], [u.elems])
            self.native.gather_into(u.index, buffer)
            flat = zerocore.to_torch(buffer)
            for g, (start, end) in zip(u.groups, u.spans):
                g.bind(flat[start:end], keep_views=False)

    def free_all(self):
        """After gathered_params: every unit's params may have been edited,
        so nothing gathered before stays."""
        self.joining = False
        self.native.release_all()
        self.native.unbind_all()
        for u in self.units:
            for g in u.groups:
                g.unbind()
        self.bound.clear()
        self.at.clear()
