"""FlatGroup's views into its buffers, by layout: a param's, a bucket's, a
run's, a segment's, each a slice the native store computes (no offset is
computed here), and what is read through them: a param's stretches on this
rank (initial values, loads, checkpoints), the runs a native step updates,
offload's copies, and the params whole in fp32. Nothing here touches the
module's params; flat_group_binding.py binds them to these buffers.
"""
from __future__ import annotations

import torch


class LayoutViews:
    """FlatGroup's views (flat_group.py has the plan, the store and the
    buffers they slice)."""

    def view(self, buffer, span: str, *args) -> torch.Tensor:
        """The slice of `buffer` at the store's span `span` (PartitionStore's
        <span>_span: "param", "bucket", "shard", "run", "segment"; args: its
        indices). buffer: a kind the store keeps ("master", "state.exp_avg",
        ...) or a whole or partition-sized tensor of this plan (a gather
        pool slot)."""
        t = self._buffer(buffer) if isinstance(buffer, str) else buffer
        lo, n = getattr(self.store, f"{span}_span")(t.numel(), *args)
        return t[lo:lo + n]

    def partition_from_flat(self, flat: torch.Tensor, out: torch.Tensor):
        """Copies this rank's block of every bucket of `flat` into `out` (any dtype)."""
        for b in range(len(self.buckets)):
            self.view(out, "bucket", b).copy_(self.view(flat, "shard", b, self.rank))

    # A param's stretches on this rank ----------------------------------------
    def param_stretches(self, index: int) -> list:
        """Where param `index` (of self.params) lives on this rank: (first
        element, elements, buffer views they go to): the whole param where
        this rank holds the flat buffer, its stretches of the shard and the
        fp32 master."""
        out = [] if self.sharded else self._stretches(["full"], index)
        parts = [kind for kind in ("shard", "master") if self.store.has(kind)]
        return out + (self._stretches(parts, index) if parts else [])

    def state_stretches(self, name: str, index: int) -> list:
        """As param_stretches, for optimizer state `name` of param `index`."""
        return self._stretches([f"state.{name}"], index)

    def _stretches(self, kinds, index: int) -> list:
        """(first element, elements, views) of each piece of param `index` in
        the buffers of `kinds`, which have one layout (all whole or all
        partitions)."""
        buffers = [self._buffer(kind) for kind in kinds]
        return [(first, span.numel, [b[span.offset:span.offset + span.numel] for b in buffers])
                for first, span in self.store.param_spans(buffers[0].numel(), index)]

    @staticmethod
    def load(stretches, read):
        """Fills stretches (param_stretches, state_stretches) with
        read(first, n): elements first..first+n-1 of the flattened param or
        state, in any floating dtype."""
        for first, n, outs in stretches:
            values = read(first, n)
            for out in outs:
                out.copy_(values)

    def load_param(self, index: int, read):
        """Sets param `index` on this rank from read (see load)."""
        self.load(self.param_stretches(index), read)

    def owned_stretches(self, partition: torch.Tensor):
        """(param index, first element, values) of each stretch of this
        rank's partition, from `partition` (a partition-sized buffer)."""
        return [(seg.param, seg.param_offset, self.view(partition, "segment", i))
                for i, seg in enumerate(self.segments)]

    # The runs a native step updates ---------------------------------------
    def _run_view(self, kind, run: int):
        return self.view(kind, "run", run) if kind is not None else None

    @property
    def _live(self) -> str:
        """The kind of the params training reads."""
        return "shard" if self.sharded else "full"

    def run_views(self) -> list:
        """Per run of this rank's partition, the views a native step updates:
        (param group, fp32 param, grad, state0, state1, 16-bit param copy),
        as the native store picks them (PartitionStore::flat_runs, which a
        C++ embedder's step takes too): DLPack arrays, None where there is
        none. Offloaded, they are the host's: its grads, and its own 16-bit
        copy (offload_copies says where they go). They never move, so the
        engine converts them once (ops.FlatRuns)."""
        return self.store.flat_runs()

    def offload_copies(self, run: int) -> tuple:
        """Offloaded: the run's (grads down, params up) copies, as (source,
        destination) pairs, and its spare host grad: the reduced grads into
        the host's (none where reduction leaves them there), the host step's
        new params (its 16-bit copy, or the fp32 master) into the params
        training reads, and the buffer reduction fills where the two swap
        (None elsewhere). run: an index into self.runs."""
        spare = self._run_view("grad_part", run) if self.swaps_grads else None
        # Only stage 1 reduces into a grad buffer (grad_full) that is not the host's.
        down = [(self._run_view("grad_full", run), self._run_view("host_grad", run))] \
            if self.grad_full is not None else []
        new = "host_param" if self.host_param is not None else "master"
        return down, [(self._run_view(new, run), self._run_view(self._live, run))], spare

    # The params whole in fp32 ---------------------------------------------
    def fp32_partition(self) -> torch.Tensor:
        """This rank's partition of the params in fp32 (the master if any)."""
        if self.master is not None:
            return self.master
        if self.sharded:
            return self.shard.float()
        out = torch.empty(self.plan.partition_elems, dtype=torch.float32, device=self.full.device)
        self.partition_from_flat(self.full, out)  # block by block: no full-size fp32 temporary
        return out

    def full_fp32(self) -> torch.Tensor:
        """The whole flat buffer in fp32, on every rank (uncounted gather)."""
        part = self.fp32_partition()
        world, plan = self.plan.world_size, self.plan
        if world == 1:
            return part
        device = self.params[0].device  # where training runs: the data group moves its memory (NCCL's on CUDA)
        parts = torch.empty(world * plan.partition_elems, dtype=torch.float32, device=device)
        mine = parts.view(world, -1)[self.rank]
        mine.copy_(part)  # an offloaded master or shard is host memory
        self.comm.all_gather(parts, mine, (self.tag, -1), count=False)
        flat = torch.empty(plan.total_elems, dtype=torch.float32, device=device)
        for r, rank_part in enumerate(parts.view(world, -1)):
            for b in range(len(self.buckets)):
                self.view(flat, "shard", b, r).copy_(self.view(rank_part, "bucket", b))
        return flat
