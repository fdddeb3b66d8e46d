"""ZeRO-Offload: the optimizer step on the host (docs/offload.md).

With Config(offload_optimizer="cpu") each rank's fp32 master params,
optimizer states and the grads its step reads live in host memory
(FlatGroup.buffer_plan says which buffer lives where), and the native
step (ZeroStep) drives the native OffloadOptimizer (cpp/include/zerocore/
offload/offload_optimizer.h) over them through the HostUpdate
(step/host_update.h) the engine's EngineCore builds over it, in the step's
one native call:

    backward  reduced grads reach the host bucket by bucket: in stages 2-3
              the reducer adds each bucket's block into the host partition
              as soon as its reduce-scatter is done; stage 1 reduces at the
              step and copies the rank's blocks down then
    step      the grads' verdict (finite or not, summed over ranks) or,
              with clipping or fp16, their squared norm in the step's one
              control all-reduce -> the CPU optimizer updates bucket after
              bucket on a native thread while the copy queue sends each
              updated bucket's params up; the training thread waits for
              none of it (the next forward's compute waits for the params)

Delayed update (Config(delayed_update=True)), from step
delayed_update_warmup + 1 on: step() queues the update and returns at once,
so the host updates step t while the device computes step t+1's forward
and backward on the params it has; step t+1's step() waits for that
update, copies its params up and queues its own. In stages 2-3 the host
grad partition is double-buffered: backward t+1 reduces into one buffer
while update t reads the other, and at the step they swap, with no copy.
Writing W_t for the master params after step t and g(W) for grads
computed at params W:

    warm-up steps      W_t = update(W_{t-1}, g(W_{t-1}))
    delayed steps      W_t = update(W_{t-1}, g(W_{t-2}))   (one step stale)

Reading or saving the model (full_state_dict, gathered_params, save, load,
load_state_dict) first finishes a pending update and copies it up, so what
is read is W_t and a resumed run continues exactly as one that saved.
"""
from __future__ import annotations

import json
import os
import socket

from zerocore import _native, ops


class OffloadUpdate:
    """The host step of a rank's partition (state/partition_update.py's interface)."""

    def __init__(self, groups, placement, config, backend):
        buckets, run_grad_bytes, up_bytes = [], 0, 0
        self.swapping = [g for g in groups if g.trainable and g.swaps_grads]
        for g in groups:
            if not g.trainable:
                continue
            by_bucket = {}
            for k, (run, view) in enumerate(zip(g.runs, g.run_views())):
                down, up, spare = g.offload_copies(k)
                views, downs, ups, spares = by_bucket.setdefault(run.bucket, ([], [], [], []))
                views.append(view)
                downs += down
                ups += up
                if spare is not None:
                    spares.append(spare)
            buckets += [(ops.FlatRuns(*[list(c) for c in zip(*views)]), downs, ups, spares)
                        for views, downs, ups, spares in by_bucket.values()]
            # Counted by the params' own elements (runs span the alignment gaps between them).
            numel = sum(seg.numel for seg in g.segments)
            run_grad_bytes += numel * g.reduce_dtype.itemsize
            up_bytes += numel * (g.host_param if g.host_param is not None else g.master).element_size()
        self.native = _native.OffloadOptimizer(buckets, backend)  # on the engine's backend: its copy and update streams
        # What the native step (ZeroStep) drives, the EngineCore's (use): the
        # host grads taken, the update, its params up at once or at the next
        # step boundary.
        self.host = None
        self.core = None
        # Bytes crossing between device and host (PCIe on a GPU): the grads
        # of each backward (stages 2-3) or step (stage 1), the params of
        # each update. Copies between two host buffers are not counted.
        self.grad_bytes_per_backward = run_grad_bytes if placement.partitions_grads else 0
        self.grad_bytes_per_step = 0 if placement.partitions_grads else run_grad_bytes
        self.param_bytes = 0 if placement.params_on_host else up_bytes
        self._grad_bytes = 0
        self._params_sent_before = 0  # host.params_sent at the last reset_stats()

    def use(self, core):
        """core: the EngineCore whose HostUpdate drives self.native."""
        self.core, self.host = core, core.host_update

    @property
    def serial(self) -> bool:
        """The params go up only once the whole update is done (the
        step-by-step schedule the overlap is measured against)."""
        return self.host.serial

    @serial.setter
    def serial(self, value: bool):
        self.host.serial = value

    @property
    def pending(self) -> bool:
        """An update queued whose params are not up yet."""
        return self.host.pending

    def count_grads(self, backward_calls: int):
        """The step's exchange is about to take the host grads of
        backward_calls backwards (comm_stats)."""
        self._grad_bytes += self.grad_bytes_per_step + backward_calls * self.grad_bytes_per_backward

    def follow_swaps(self):
        """After a native step call: the stores follow the swaps the step
        made, in one native call (EngineCore.follow_swaps: reduction then
        fills the buffer the update does not read), and the groups' views
        of their host grad buffers with them."""
        for _ in range(self.core.follow_swaps()):
            for g in self.swapping:
                g.grads_swapped()

    def params_up(self) -> bool:
        """Copies a pending update's params up and waits for the update
        queued (the host reads the master or states next); True when one
        was pending."""
        return self.host.finish()

    def stats(self) -> dict:
        sent = self.host.params_sent - self._params_sent_before
        return {"offload": {"grad_bytes_to_host": self._grad_bytes, "param_bytes_to_device": sent * self.param_bytes}}

    def reset_stats(self):
        self._grad_bytes = 0
        self._params_sent_before = self.host.params_sent


def available_host_bytes() -> int:
    """Memory the OS can give this host's processes now (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_memory_problem(groups, comm):
    """A MemoryError when the host buffers of the plan do not fit the host
    memory available, counting every rank that shares this host; None when
    they fit. One collective; every rank reaches the same verdict."""
    need = sum(g.planned_bytes("host") for g in groups)
    mine = {"host": socket.gethostname(), "need": need, "available": available_host_bytes()}
    ranks = [json.loads(text) for text in comm.gather_text(json.dumps(mine))]
    for host in sorted({r["host"] for r in ranks}):
        on_host = [i for i, r in enumerate(ranks) if r["host"] == host]
        total = sum(ranks[i]["need"] for i in on_host)
        available = min(ranks[i]["available"] for i in on_host)
        if total > available:
            return MemoryError(
                f"zerocore.wrap: the offloaded model states need {total:,} bytes of host memory on {host} "
                f"(rank(s) {on_host}, {ranks[on_host[0]]['need']:,} bytes each on rank {on_host[0]}), but only "
                f"{available:,} are available; use more hosts or ranks, offload less (offload_params=None), or "
                "free host memory. Nothing was allocated.")
    return None
