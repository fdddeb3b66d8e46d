"""Gradient reduction across data-parallel ranks: the Python side.

FullGradReducer (stages 0-1): autograd accumulates into views of each
group's flat grad buffer; at the step boundary the native BucketCollectives
all-reduces (stage 0) or reduce-scatters (stage 1) every bucket in place,
once per step however many backward calls came before.

StagedReducer (stages 2-3): each param's grad, once autograd has
accumulated it, is the native BucketReducer's (cpp/include/zerocore/
schedule/bucket_reducer.h), which stages it in its bucket, reduce-scatters
complete buckets in one fixed order on every rank and adds each rank's
block into its grad partition; only the partitions and a few constant-size
staging buffers outlive backward. Where it can, autograd accumulates
straight into the staging: a param's .grad is its view into its bucket's
staging buffer before its grad comes (a grad view), so the hook only tells
the reducer; the others' grads are copied in and dropped. In stage 3 the
native unit schedule's rounds say when a unit's buckets are reduced, since
ranks may run different units: it holds the native reducer and reduces them
itself. Params that produced no grad count as zero; a grad that arrives
after its bucket was reduced (reentrant checkpointing) stays staged, and
the step's exchange (ZeroStep) has every rank reduce the buckets late on
any rank once more.

The native parts are the engine's core's (zerocore._native.EngineCore,
cpp/include/zerocore/engine/engine_core.h), which builds them and connects
the reducer to the schedule and the step: these classes only hook autograd
to them.
"""
from __future__ import annotations

import weakref

import zerocore
from zerocore.state.guards import GradPlaceholder


def outside_engine_backward() -> RuntimeError:
    """The error of a backward pass the engine did not start, raised from
    the first hook of the engine's it reaches, before anything is reduced."""
    return RuntimeError("zerocore: a backward ran outside engine.backward (loss.backward() or torch.autograd on a "
                        "wrapped model's output): call engine.backward(loss), which reduces the grads across ranks "
                        "as autograd produces them")


def _guard_each(params, running):
    """A backward outside engine.backward after one inside it
    (engine.backward(loss), then loss.backward()) would accumulate into the
    placeholders hide_grads left in .grad, whose one repeated element torch
    refuses to write (its memory-overlap error). A hook on each param, run
    before its grad accumulates, raises zerocore's error instead, before
    any is accumulated. running: whether engine.backward is running."""
    def guard(p):
        def hook(grad):
            if not running() and isinstance(p.grad, GradPlaceholder):
                raise outside_engine_backward()
        return hook
    return [p.register_hook(guard(p)) for p in params]


def _hook_each(params, method):
    """Registers method as every param's post-accumulate-grad hook. The hooks
    live on the params, where the garbage collector cannot see them, so they
    hold the reducer weakly, or it would never be freed."""
    ref = weakref.WeakMethod(method)
    return [p.register_post_accumulate_grad_hook(lambda p: ref() and ref()(p)) for p in params]


class FullGradReducer:
    """Stages 0-1: core: the EngineCore, whose grad_reduce reduces the
    grads (or, with Config(deterministic=True), their int64 sums) at the step."""

    def __init__(self, groups, core):
        self.groups = [g for g in groups if g.trainable]
        # A .grad must have its param's dtype: with another reduce dtype,
        # each grad is added into the buffer (converted) once accumulated.
        self.converted = {id(p): (g, i) for g in self.groups if g.reduce_dtype != g.dtype
                          for i, p in enumerate(g.params)}
        self.hooks = _hook_each([g.params[i] for g, i in self.converted.values()], self._on_grad)
        self.running = False  # inside engine.backward
        ref = weakref.ref(self)
        self.hooks += _guard_each([p for g in self.groups for p in g.params], lambda: ref() is None or ref().running)
        self.collectives = core.grad_reduce

    def before_backward(self):
        self.running = True
        for g in self.groups:
            if g.reduce_dtype == g.dtype:
                g.binder.attach_grad_views()
            else:
                g.binder.drop_hidden_grads()

    def _on_grad(self, p):
        if not self.running:
            raise outside_engine_backward()
        g, i = self.converted[id(p)]
        g.binder.grad_view(i).add_(p.grad)
        p.grad = None

    def after_backward(self):
        self.running = False

    def drop_staged(self):
        """zero_grad: nothing to drop, the grads live in the groups' flat buffers."""


class StagedReducer:
    """The hooks of the native BucketReducer (zerocore._native): each
    param's grad, once accumulated, is handed to it, and dropped.

    Grad views: a param's .grad may be its piece of its bucket's staging
    buffer (reduce dtype = param dtype, the param in one bucket), set before
    autograd produces its grad, so that autograd adds into it in place. The
    staging buffers are few and reused, so a view exists only while its
    bucket holds one: at stage 3 the unit's groups take theirs before its
    backward (attach_grad_views); at stage 2 the reducer hands them out as
    buckets take staging, in plan order (begin_backward, then each
    grad_ready), and a param whose grad comes before its bucket's turn is
    copied. A bucket goes out no sooner than each of its params has
    reported (stage 3: than no rank expects its unit's backward), so a view
    is never reduced while a grad is still to come into it, and the hook or
    after_backward drops it: no .grad the user sees outlives the backward as
    a view of reused memory."""

    def __init__(self, groups, core, exact=None):
        """groups: the engine's flat groups, as the core has them; core:
        the EngineCore whose reducer this hooks autograd to."""
        self.core = core
        # Config(deterministic=True): the exact_grads.ExactGradSum whose
        # sums the native reducer adds into, each grad put on its grid as
        # it is staged (grad_ready's grid_exponent).
        self.exact = exact
        self.on_request = core.stage == 3
        self.place = {id(g): i for i, g in enumerate(groups)}  # in the core's groups
        self._follow_order([g for g in groups if g.trainable])
        self.hooks = _hook_each([p for g in self.groups for p in g.params], self._on_grad)
        self.running = False  # inside engine.backward
        ref = weakref.ref(self)
        self.hooks += _guard_each([p for g in self.groups for p in g.params], lambda: ref() is None or ref().running)
        self.viewed = {}  # id(param) -> (param, its .grad: a view into a staging buffer), until its grad comes

    def order(self, groups):
        """Reduces `groups` in this order, each under its tag (tests reorder
        them, or retag one, on one rank to check the order contract): the
        core rebuilds its reducer (set_reduction_order)."""
        self.core.set_reduction_order([(self.place[id(g)], g.tag) for g in groups])
        self._follow_order(groups)

    def _follow_order(self, groups):
        """The core's reducer reduces `groups` in this order."""
        self.groups = groups
        self.index = {id(g): i for i, g in enumerate(groups)}
        self.where = {id(p): (i, j) for i, g in enumerate(groups) for j, p in enumerate(g.params)}
        self.native = self.core.reducer

    @property
    def pool_bytes(self) -> int:
        return self.native.staging_bytes

    @property
    def landing_bytes(self) -> int:
        """Host memory the reduced shards of host grad partitions land in."""
        return self.native.landing_bytes

    def before_backward(self):
        """Reduction adds into each group's grad_part as it is now: a
        delayed offload update swaps it with the buffer it reads. The
        params' .grad are None, for autograd to fill; at stage 2 those of
        the first bucket to reduce are grad views."""
        self.running = True
        for g in self.groups:
            g.binder.drop_hidden_grads()
        self.core.before_backward()
        if not self.on_request and self._views():
            self._attach_handed(self.native.begin_backward())

    def attach_grad_views(self, group):
        """Stage 3, before a unit's backward: each param's .grad becomes its
        view into its bucket's staging buffer (one native call a group).
        Params that straddle buckets, and buckets already reduced, keep the
        copy path."""
        if not self._views():
            return
        for p, shape, view in zip(group.params, group.shapes, self.native.grad_views(self.index[id(group)])):
            self._attach(p, shape, view)

    def _views(self) -> bool:
        """Whether autograd may accumulate into the staging (grad views):
        it holds the grads' dtype (not int64 sums, nor another reduce dtype)."""
        return not self.exact and all(g.reduce_dtype == g.dtype for g in self.groups)

    def _attach(self, p, shape, view):
        """p's .grad becomes `view` (a zerocore.Tensor of its staging, or
        None) unless it has a grad already (the copy path takes that)."""
        if view is not None and p.grad is None:
            p.grad = zerocore.to_torch(view).view(shape)
            self.viewed[id(p)] = (p, p.grad)

    def _attach_handed(self, views):
        """Stage 2: the views the reducer handed out, [(group, param, view)]."""
        for i, j, view in views:
            group = self.groups[i]
            self._attach(group.params[j], group.shapes[j], view)

    def _on_grad(self, p):
        if not self.running:
            raise outside_engine_backward()
        i, j = self.where[id(p)]
        _, view = self.viewed.pop(id(p), (None, None))
        if view is not None and p.grad is not view:
            # A user's hook put another tensor in its place (or None, a zero
            # grad): autograd had added this micro-batch's grad into the
            # view already, so the view takes the hook's value instead and
            # the grad counts once, as the hook left it.
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
            p.grad = view
        grad = p.grad.reshape(-1)
        views = self.native.grad_ready(i, j, grad, *self.exact.grid_for(grad, self.groups[i], j)) if self.exact \
            else self.native.grad_ready(i, j, grad)
        p.grad = None
        self._attach_handed(views)

    def after_backward(self):
        """Reduces what is left (params that got no grad count as zero) and
        waits until every reduction is in the partitions; late grads wait
        for the step."""
        self.running = False
        for p, _ in self.viewed.values():  # views of params that got no grad must not outlive the backward
            p.grad = None
        self.viewed = {}
        self.native.end_backward()

    def drop_staged(self):
        """zero_grad: late grads staged for the step go."""
        self.native.drop_late()
