"""ProcessGroupTransport: the native comm queue's transport over a
torch.distributed process group.

The queue (zerocore._native.CommQueue) runs every collective of the engine
in issue order on its own thread; for a torch.distributed group it calls
these methods there, with the GIL held, one collective at a time. Tensors
arrive as DLPack views of the caller's tensors, so each collective works in
place on the engine's buffers; each call returns once its collective is
done.

On gloo (host tensors) the tensor collectives all_gather_into_tensor and
reduce_scatter_tensor allocate full-size temporaries on every call, so peak
memory would depend on the system allocator, and they are the slowest of
gloo's collectives. There an all-gather is one in-place broadcast of each
rank's block (the same bytes moved) and a reduce-scatter an in-place
all-reduce of the bucket, of which this rank keeps its block; both measured
faster than gloo's own at 2 ranks (bench/RESULTS.md). Other backends (NCCL)
get the tensor collectives.
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
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.world_size)]
        self.in_place = dist.get_backend(group) == "gloo"

    def all_gather(self, shard, output):
        """output (world_size x shard) <- every rank's shard."""
        output, shard = torch.from_dlpack(output), torch.from_dlpack(shard)
        if not self.in_place:
            _all_gather_single(output, shard, group=self.group)
            return
        blocks = output.view(self.world_size, -1)
        if blocks[self.rank].data_ptr() != shard.data_ptr():
            blocks[self.rank].copy_(shard)
        works = [dist.broadcast(blocks[r], self.global_ranks[r], group=self.group, async_op=True)
                 for r in range(self.world_size)]
        for w in works:
            w.wait()

    def reduce_scatter(self, input, shard):
        """shard <- this rank's block of the sum of every rank's input (the
        rest of input is scratch)."""
        input, shard = torch.from_dlpack(input), torch.from_dlpack(shard)
        if not self.in_place:
            _reduce_scatter_single(shard, input, group=self.group)
            return
        dist.all_reduce(input, group=self.group)
        mine = input.view(self.world_size, -1)[self.rank]
        if mine.data_ptr() != shard.data_ptr():
            shard.copy_(mine)

    def all_reduce(self, tensor):
        dist.all_reduce(torch.from_dlpack(tensor), group=self.group)

    def broadcast(self, tensor, root):
        """tensor <- the tensor of rank `root` of the group."""
        dist.broadcast(torch.from_dlpack(tensor), self.global_ranks[root], group=self.group)
