"""The engine's reports (Reports): the bytes this rank holds (memory_report), the
elements its collectives moved (comm_stats), and the loss scale. Each is
read from what the engine holds or counts (the groups' buffers, the
backend's comm buffers, the queues' counters), never estimated:
zerocore.accounting and zerocore.estimate give the formulas they are
checked against (docs/formulas.md).
"""
from __future__ import annotations

from zerocore.zero_r import buffers as checkpoint_buffers
from zerocore.engine.build import EngineParts


class Reports:
    """The reports of `parts`; `snapshots` (Config(snapshot="memory"),
    else None) report the memory they hold."""

    def __init__(self, parts: EngineParts, snapshots=None):
        self.parts, self.snapshots = parts, snapshots

    def loss_scale(self) -> float:
        return self.parts.scaler.scale

    def memory_report(self) -> dict:
        """Engine.memory_report has the contract."""
        parts = self.parts
        by = {at: {"param": 0, "grad": 0, "optim": 0} for at in ("device", "host")}
        for at, counts in by.items():
            for g in parts.groups:
                for k, v in g.memory(at).items():
                    counts[k] += v
        if parts.exact:  # Config(deterministic=True)'s exact sums of the grads, where the groups do not hold them
            by["device"]["grad"] += parts.exact.own_bytes
        by["device"]["buffers"] = sum(b.numel() * b.element_size() for b in parts.module.buffers())
        by["host"]["buffers"] = 0
        by["device"]["comm_buffers"] = getattr(parts.reducer, "pool_bytes", 0) + \
            (parts.scheduler.native.buffer_bytes if parts.scheduler else 0) + parts.zero_step.device_buffer_bytes
        # The step's exchange row and verdict readbacks; the landing buffer of reduced grads bound for the host.
        by["host"]["comm_buffers"] = parts.zero_step.buffer_bytes + getattr(parts.reducer, "landing_bytes", 0)
        by["device"]["activations"] = checkpoint_buffers.buffer_bytes(offloaded=False)
        by["host"]["activations"] = checkpoint_buffers.buffer_bytes(offloaded=True)
        if self.snapshots:  # Config(snapshot="memory"): their files (own and mirrors'), the mirrors' buffers
            transport = parts.snapshot_transport
            by["device"]["snapshots"] = transport.device_bytes if transport else 0
            by["host"]["snapshots"] = self.snapshots.bytes_held
        return {**{k: by["device"][k] + by["host"][k] for k in by["device"]}, "by_device": by}

    def comm_stats(self) -> dict:
        """Engine.comm_stats has the contract."""
        moved = self.parts.comm.stats
        if self.parts.reduce_comm:
            moved.update(self.parts.reduce_comm.stats)  # Counter.update adds
        return {**moved, **self.parts.update.stats()}

    def reset_comm_stats(self):
        """Starts a new comm_stats() window at zero."""
        for comm in filter(None, (self.parts.comm, self.parts.reduce_comm)):
            comm.reset_stats()
        self.parts.update.reset_stats()
