"""ProcessGroupTransport: the native comm queue's transport over a
torch.distributed process group.

The queue (zerocore._native.CommQueue) runs every collective of the engine
in issue order on its own thread; for a torch.distributed group it calls
these methods there, with the GIL held, one collective at a time. Tensors
arrive as DLPack views of the caller's tensors, so each collective works in
place on the engine's buffers; each call returns once its collective is
done.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor collectives; keep working with older names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ProcessGroupTransport:
    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_gather(self, shard, output):
        """output (world_size x shard) <- every rank's shard."""
        _all_gather_single(torch.from_dlpack(output), torch.from_dlpack(shard), group=self.group)

    def reduce_scatter(self, input, shard):
        """shard <- this rank's block of the sum of every rank's input."""
        _reduce_scatter_single(torch.from_dlpack(shard), torch.from_dlpack(input), group=self.group)

    def all_reduce(self, tensor):
        dist.all_reduce(torch.from_dlpack(tensor), group=self.group)

    def broadcast(self, tensor, root):
        """tensor <- the tensor of rank `root` of the group."""
        dist.broadcast(torch.from_dlpack(tensor), dist.get_global_rank(self.group, root), group=self.group)
