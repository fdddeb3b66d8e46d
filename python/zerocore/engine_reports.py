"""The engine's reports: the bytes this rank holds (memory_report), the
elements its collectives moved (comm_stats), and the loss scale. Each is
read from what the engine holds or counts (the groups' buffers, the
backend's comm buffers, the queues' counters), never estimated:
zerocore.sizing.accounting and zerocore.estimate give the formulas they are
checked against (docs/formulas.md).
"""
from __future__ import annotations

from zerocore.zero_r import buffers as checkpoint_buffers


class Reports:
    """Engine's reports (engine.py holds what they read)."""

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def memory_report(self) -> dict:
        """Bytes of model states held on this rank: params, grads, optimizer
        states (fp32 master, moments), module buffers; plus the buffers
        collectives work in (comm_buffers: gradient reduction's staging, in
        stage 3 the pool units are gathered into, the step's exchange row,
        a few bytes of pinned host memory, and with offloaded grads the
        pinned buffer of one reduced shard they land in), which are not model
        states. Stage 3 params count their shard. All of it is allocated at
        wrap: the report is the same before the first step and after, except
        that stage 3's gather pool grows once (a slot, kept) when ranks need
        more units at the same time than planned (different experts on
        different ranks, units nested in units). "activations": the buffers
        zerocore.checkpoint keeps activation checkpoints in on this rank
        (allocated once, sized on the first step; with offload, the device
        buffers it packs into and copies back into appear during it).
        "by_device": the same categories split by where they live:
        "device" (where training runs) and "host" (what offload moved there:
        Config.offload_optimizer/offload_params, zerocore.checkpoint's
        offload="cpu"). "snapshots" (with Config(snapshot="memory")): the
        host and shared memory the in-memory snapshots hold on this rank, as
        of the last one written (Snapshots.bytes_held)."""
        by = {at: {"param": 0, "grad": 0, "optim": 0} for at in ("device", "host")}
        for at, counts in by.items():
            for g in self.groups:
                for k, v in g.memory(at).items():
                    counts[k] += v
        if self.exact:  # Config(deterministic=True)'s exact sums of the grads, where the groups do not hold them
            by["device"]["grad"] += self.exact.own_bytes
        by["device"]["buffers"] = sum(b.numel() * b.element_size() for b in self.module.buffers())
        by["host"]["buffers"] = 0
        by["device"]["comm_buffers"] = getattr(self.reducer, "pool_bytes", 0) + \
            (self.scheduler.native.buffer_bytes if self.scheduler else 0) + self.zero_step.device_buffer_bytes
        # The step's exchange row and verdict readbacks; the landing buffer of reduced grads bound for the host.
        by["host"]["comm_buffers"] = self.zero_step.buffer_bytes + getattr(self.reducer, "landing_bytes", 0)
        by["device"]["activations"] = checkpoint_buffers.buffer_bytes(offloaded=False)
        by["host"]["activations"] = checkpoint_buffers.buffer_bytes(offloaded=True)
        if self.snapshots:  # Config(snapshot="memory"): their files (own and mirrors')
            by["device"]["snapshots"], by["host"]["snapshots"] = 0, self.snapshots.bytes_held
        return {**{k: by["device"][k] + by["host"][k] for k in by["device"]}, "by_device": by}

    def comm_stats(self) -> dict:
        """Elements moved by each kind of collective ({"all_gather",
        "reduce_scatter", "all_reduce"}), each counted at its full,
        unpartitioned size, since wrap or the last reset_comm_stats(): reset
        before a step to measure one step (zerocore.sizing.accounting.predicted_comm
        gives the formula). Control traffic (the start-up model check, the
        step's norm exchange, buffer broadcasts) is not counted. With
        offload_optimizer, "offload" adds the bytes copied between the device
        and the host: {"grad_bytes_to_host", "param_bytes_to_device"}."""
        moved = self.comm.stats
        if self.reduce_comm:
            moved.update(self.reduce_comm.stats)  # Counter.update adds
        return {**moved, **self.update.stats()}

    def reset_comm_stats(self):
        """Starts a new comm_stats() window at zero."""
        for comm in filter(None, (self.comm, self.reduce_comm)):
            comm.reset_stats()
        self.update.reset_stats()
