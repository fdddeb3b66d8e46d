"""Where a training step's time goes (train_step_bench.py --breakdown).

Every configuration: the step's phases, timed on the host (forward,
backward, optimizer step and zero_grad).

zerocore stage 3 (StepBreakdown.instrument): within those phases, the time
in the unit hooks (module forward pre/post hooks, the backward hooks, the
saved-tensor pack/unpack hooks), in the grad hooks (each param's grad
handed to the reducer) and, inside them and outside, in the native calls
they make (the schedule's hooks, the reducer's grad_views and grad_ready):
the native schedule calls wait for the unit's gather (a stream wait: on the
CPU backend the caller blocks) and settle the rounds, whose waits the
schedule counts itself (round_seconds); grad_views may wait for a
reduction in flight to free staging; the rest of a hook is Python. Forward
and backward compute is the phase's time less everything instrumented.

The collectives alone (collectives_alone): the data-plane collectives one
step of the engine issued (its queue's trace: kind and size of each, in
order), issued again back to back through the engine's transport on a
group of the same ranks, with no compute; against all-reduces of the same
number of grad elements in DDP's buckets (the first 1 MiB, then 25 MiB:
DDP's defaults). Lowest of a few repeats.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict

# Native calls timed: the unit schedule's and the gradient reducer's.
SCHEDULE_CALLS = ("pre_forward", "post_forward", "begin_backward", "pre_backward", "post_backward", "end_forward",
                  "end_backward", "take_released", "read")
REDUCER_CALLS = ("grad_ready", "grad_views", "end_backward")


class _Timed:
    """Forwards every attribute to `target`; the calls named in `calls` add
    their seconds to totals["<prefix>.<name>"] and to totals["native"]."""

    def __init__(self, target, totals, prefix, calls):
        self._target, self._totals, self._prefix, self._calls = target, totals, prefix, calls

    def __getattr__(self, name):
        attr = getattr(self._target, name)
        if name not in self._calls:
            return attr
        totals, key = self._totals, f"{self._prefix}.{name}"

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                totals[key] += dt
                totals["native"] += dt
        return timed


class StepBreakdown:
    """Times one rank's steps by phase; per step, a dict of seconds."""

    def __init__(self):
        self.totals = defaultdict(float)
        self.steps = []
        self.schedule = None
        self._mark = None

    # Stage 3's hooks --------------------------------------------------------
    def instrument(self, engine):
        """Times the stage 3 engine's hooks and native calls (see the module's doc)."""
        scheduler = engine.scheduler
        self.schedule = scheduler.native
        scheduler.native = _Timed(scheduler.native, self.totals, "schedule", SCHEDULE_CALLS)
        engine.reducer.native = _Timed(engine.reducer.native, self.totals, "reducer", REDUCER_CALLS)
        for h in scheduler.handles:  # module forward pre/post hooks
            hooks = h.hooks_dict_ref()
            hooks[h.id] = self._hook("hook.forward", hooks[h.id])
        pre_backward, post_backward = scheduler._pre_backward, scheduler._post_backward
        scheduler._pre_backward = lambda unit: self._hook("hook.backward", pre_backward(unit))
        scheduler._post_backward = lambda unit: self._hook("hook.backward", post_backward(unit))
        views = scheduler.saved_views
        views.pack_hook = self._hook("hook.saved_tensors", views.pack_hook)
        views.unpack_hook = self._hook("hook.saved_tensors", views.unpack_hook)
        for h in engine.reducer.hooks:  # each param's post-accumulate-grad hook
            hooks = h.hooks_dict_ref()
            hooks[h.id] = self._hook("hook.grad", hooks[h.id])

    def _hook(self, key, fn):
        """fn, adding its seconds to totals[key] and the Python part of them
        (its time less the native calls within it) to totals["hook.python"]."""
        totals = self.totals

        def timed(*args, **kwargs):
            native0, t0 = totals["native"], time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                totals[key] += dt
                totals["hook.python"] += dt - (totals["native"] - native0)
        return timed

    # Phases -----------------------------------------------------------------
    def begin(self):
        self.totals.clear()
        self._rounds = self._counters()
        self._mark = time.perf_counter()

    def phase(self, name):
        """The phase `name` ended now."""
        now = time.perf_counter()
        self.totals[f"phase.{name}"] += now - self._mark
        self._mark = now

    def end(self):
        step = dict(self.totals)
        if self.schedule is not None:
            now = self._counters()
            step.update({k: now[k] - self._rounds[k] for k in now})
        self.steps.append(step)

    def _counters(self):
        s = self.schedule
        if s is None:
            return {}
        return {"rounds": s.rounds, "blocking_rounds": s.blocking_rounds, "round_seconds": s.round_seconds}

    def medians(self, first: int) -> dict:
        """The median of each figure over the steps from `first` on."""
        steps = self.steps[first:]
        keys = sorted({k for s in steps for k in s})
        return {k: statistics.median(s.get(k, 0.0) for s in steps) for k in keys}


# ------------------------------------------------------------ collectives alone


def ddp_bucket_elems(total: int, elem_bytes: int = 4) -> list:
    """DDP's default buckets over `total` grad elements: 1 MiB first, then 25 MiB."""
    sizes, first = [], True
    while total > 0:
        n = min(total, (2**20 if first else 25 * 2**20) // elem_bytes)
        sizes.append(n)
        total -= n
        first = False
    return sizes


def collectives_alone(engine, trace, repeats: int = 3) -> dict:
    """Seconds (lowest of `repeats`) of stage 3's step's data-plane
    collectives (`trace`: (kind, tag, bucket, elements) each) issued back to
    back through the engine's transport, by kind; and of DDP's all-reduces
    of the grads (the engine's trainable elements, DDP's buckets). Every
    rank calls it, with the same trace."""
    import torch
    import torch.distributed as dist

    from zerocore.comm.communicator import KINDS
    from zerocore.comm.process_group import ProcessGroupTransport

    # A group of its own: the engine's may have gathers in flight (the
    # next forward's first units, gathered at the step's end).
    group = dist.new_group(dist.get_process_group_ranks(engine.comm.group))
    world = dist.get_world_size(group)
    transport = ProcessGroupTransport(group)
    largest = max(n for *_, n in trace)
    full, shard = torch.zeros(largest), torch.zeros(largest // world)

    def issue(kind, key, n):
        if KINDS[kind] == "all_gather":
            transport.all_gather(key, shard[:n // world], full[:n])
        elif KINDS[kind] == "reduce_scatter":
            transport.reduce_scatter(key, full[:n], shard[:n // world])
        else:
            transport.all_reduce(key, full[:n])

    def timed(run):
        best = float("inf")
        for _ in range(repeats):
            dist.barrier(group)
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
        return best

    out = {}
    for kind in sorted({k for k, *_ in trace}):
        mine = [key for key in trace if key[0] == kind]
        out[f"{KINDS[kind]} x{len(mine)}"] = timed(lambda: [issue(k[0], k, k[3]) for k in mine])
    out["stage 3, all"] = timed(lambda: [issue(k[0], k, k[3]) for k in trace])
    buckets = ddp_bucket_elems(engine.num_trainable_params)
    grads = torch.zeros(max(buckets))
    out[f"ddp all_reduce x{len(buckets)}"] = timed(
        lambda: [dist.all_reduce(grads[:n], group=group) for n in buckets])
    return out


# ------------------------------------------------------------------ report


def stage3_schedule(engine):
    """The engine's native unit schedule if it is stage 3's (with rounds), else None."""
    schedule = getattr(engine.scheduler, "native", None)
    return schedule if hasattr(schedule, "rounds") else None


def stage3_lines(b: dict) -> list:
    """Lines of stage 3's hook, native-call and round figures in median
    figures `b` (StepBreakdown.medians after instrument), ms; none without."""
    if "rounds" not in b:
        return []
    ms = lambda k: f"{1e3 * b.get(k, 0.0):7.1f}"
    native = {k: b[k] for k in b if k.startswith(("schedule.", "reducer."))}
    hooks = b.get("hook.forward", 0) + b.get("hook.backward", 0) + b.get("hook.saved_tensors", 0) + \
        b.get("hook.grad", 0)
    return [f"hooks {1e3 * hooks:.1f} ms (forward {ms('hook.forward')}, backward {ms('hook.backward')}, saved "
            f"tensors {ms('hook.saved_tensors')}, grads {ms('hook.grad')}); their Python {ms('hook.python')}",
            "native calls, ms: " + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in sorted(native.items()) if v >= 5e-5),
            f"rounds {b['rounds']:.0f} ({b['blocking_rounds']:.0f} blocking), waiting for them "
            f"{ms('round_seconds')} ms"]


def print_breakdown(ranks: list) -> None:
    """Each rank's median figures, ms (rounds: counts), as run_config's ranks hold them."""
    for r in ranks:
        b = r.get("breakdown")
        if not b:
            continue
        ms = lambda k: f"{1e3 * b.get(k, 0.0):7.1f}"
        phases = "  ".join(f"{k[6:]} {ms(k)}" for k in ("phase.fwd", "phase.bwd", "phase.opt", "phase.zero_grad"))
        print(f"           rank {r['rank']} phases, ms: {phases}", flush=True)
        lines = stage3_lines(b)
        for line in lines:
            print("             " + line, flush=True)
        if lines and "alone" in r:
            print("             collectives alone, ms: " + ", ".join(f"{k} {1e3 * v:.1f}"
                                                                   for k, v in r["alone"].items()), flush=True)
