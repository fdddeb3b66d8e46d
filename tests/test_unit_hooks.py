"""Stage 3's unit hooks, one native call each (issue 20, item 5): a hook
calls the native UnitSchedule once, and that call returns what to bind and
what to release, so Python never asks where a unit is gathered; a group's
grad views are one call to the native BucketReducer, and the rounds reduce
a unit's grads inside the schedule, with no call back into Python. Every
attribute Python takes from the schedule and the reducer in a step is
counted (each is a call into the runtime), and so are the torch views of
the schedule's buffers made, on 2 ranks, in the steps after the first
(which makes the views of the pool's slots, kept from then on)."""
import collections

import torch

import zerocore
from dist_harness import run_ranks
from models import lm_batch, lm_loss, local, make

STEPS = 3
HOOKS = ("pre_forward", "post_forward", "pre_backward", "post_backward")


class Counting:
    """The native schedule, every attribute asked of it counted."""

    def __init__(self, native):
        self.native = native
        self.calls = collections.Counter()

    def __getattr__(self, name):
        self.calls[name] += 1
        return getattr(self.native, name)


def _calls_a_step(rank, world, layers):
    model = make(layers=layers)
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"stage": 3})
    counting = engine.parts.scheduler.native = Counting(engine.parts.scheduler.native)
    reducer = engine.parts.reducer.native = Counting(engine.parts.reducer.native)
    # Unit forwards, counted by hooks of the test's own on the unit modules.
    forwards = collections.Counter()
    for u in engine.parts.units:
        u.modules[0].register_forward_pre_hook(lambda m, args, i=u.index: forwards.update([i]))
    steps = []
    for step in range(STEPS):
        counting.calls.clear()
        reducer.calls.clear()
        forwards.clear()
        views = len(engine.parts.scheduler.flats)
        x, y = lm_batch(step, 0, world)
        engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
        engine.step()
        engine.zero_grad()
        steps.append((dict(counting.calls), sum(forwards.values()), len(engine.parts.scheduler.flats) - views,
                      dict(reducer.calls)))
    groups = len(engine.parts.reducer.groups)
    params = sum(len(g.params) for g in engine.parts.reducer.groups)
    return steps[1:], len(engine.parts.units), groups, params


def test_a_unit_hook_is_one_native_call():
    by_layers = {}
    for layers in (2, 6):
        for steps, units, groups, params in run_ranks(_calls_a_step, 2, layers):
            for calls, forwards, views, reducer in steps:
                assert units == layers + 1
                # The reducer: one call per trainable group for its grad views
                # (each unit's backward runs once), one per param's grad (its
                # autograd hook: noted, the grad accumulated in its view), and
                # per step the end of the backward and zero_grad's drop of late
                # grads. The rounds' reductions are the schedule's own calls.
                assert reducer == {"grad_views": groups, "grad_ready": params, "end_backward": 1,
                                   "drop_late": 1}, reducer
                assert forwards == units  # each unit's forward runs once
                # One call per forward hook, at most one per backward hook.
                assert calls["pre_forward"] == calls["post_forward"] == forwards, calls
                assert calls["post_backward"] <= calls["pre_backward"] <= forwards, calls
                assert views == 0  # the slots' torch views are kept
                # Nothing else per unit: the rest is the same whatever the number of units.
                by_layers.setdefault(layers, set()).add(
                    tuple(sorted((k, n) for k, n in calls.items() if k not in HOOKS)))
    assert len(by_layers[2]) == 1 and by_layers[2] == by_layers[6], by_layers
    rest = dict(next(iter(by_layers[2])))
    # Per pass and per step: begin_backward, end_forward (by the root's
    # post-hook, and again, doing nothing, as the engine's forward ends),
    # end_backward, and after each but begin_backward the units it
    # released; after the step too, whose end-of-step round the native step
    # runs itself (no end_step call from Python).
    assert rest == {"begin_backward": 1, "end_forward": 2, "end_backward": 1, "take_released": 4}, rest
