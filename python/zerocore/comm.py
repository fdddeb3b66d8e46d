"""Collectives over a torch.distributed process group, counted by kind.

Data-plane collectives (the ones whose volume the ZeRO formulas predict)
are counted in elements at their full, unpartitioned size: an all-gather
by its output, a reduce-scatter by its input, an all-reduce by its tensor.
Control-plane traffic (layout checks, overflow flags, norms, buffer
broadcasts, checkpoint gathers) is not counted.

Without a process group (stage 0 on one process) every collective is the
identity, still counted, so the accounting reads the same.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

KINDS = ("all_gather", "reduce_scatter", "all_reduce")

# torch 2.13 renamed the tensor collectives; keep working with older names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Done:
    """The handle of a collective that finished synchronously."""

    def wait(self):
        return True


class Communicator:
    def __init__(self, group):
        self.group = group
        self.distributed = group is not None
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.stats = Counter({k: 0 for k in KINDS})

    def reset_stats(self):
        self.stats = Counter({k: 0 for k in KINDS})

    # Data plane -----------------------------------------------------------
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op=False, count=True):
        """output (N x shard) <- every rank's shard; in place when shard is
        this rank's block of output."""
        if count:
            self.stats["all_gather"] += output.numel()
        if not self.distributed:
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return _Done()
        work = _all_gather_single(output, shard, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def reduce_scatter(self, shard: torch.Tensor, input: torch.Tensor, async_op=False):
        """shard <- this rank's block of the sum of every rank's input; in
        place when shard is this rank's block of input."""
        self.stats["reduce_scatter"] += input.numel()
        if not self.distributed:
            if shard.data_ptr() != input.data_ptr():
                shard.copy_(input)
            return _Done()
        work = _reduce_scatter_single(shard, input, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def all_reduce(self, tensor: torch.Tensor, async_op=False):
        self.stats["all_reduce"] += tensor.numel()
        if not self.distributed:
            return _Done()
        work = dist.all_reduce(tensor, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    # Control plane (uncounted) --------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src_rank: int = 0):
        if self.distributed:
            dist.broadcast(tensor, dist.get_global_rank(self.group, src_rank), group=self.group)

    def sum_scalars(self, values):
        """Sums a list of floats over ranks (float64)."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.distributed:
            dist.all_reduce(t, group=self.group)
        return t.tolist()

    def gather_ints(self, value: int) -> list:
        """Every rank's int, in rank order."""
        if not self.distributed:
            return [value]
        t = torch.tensor([value], dtype=torch.int64)
        out = torch.empty(self.world_size, dtype=torch.int64)
        _all_gather_single(out, t, group=self.group)
        return out.tolist()
