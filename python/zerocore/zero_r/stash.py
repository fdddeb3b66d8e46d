"""One checkpoint's inputs as this rank keeps them: its slice of each
tensor across the checkpoint's group (Partition), in a segment of its
backend's memory (buffers.py), gathered back for the recomputation."""
from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist

from zerocore.comm.process_group import all_gather_single, private_group
from zerocore.zero_r.buffers import ALIGN, Home, allocate, error, floats, live, usage


# Process groups --------------------------------------------------------------
class Partition:
    """The ranks a checkpoint is split over: this rank's place among them and
    the group of this module's own that gathers over them (None for one rank)."""

    def __init__(self, gather_group, rank: int, world: int):
        self.gather_group, self.rank, self.world = gather_group, rank, world


SINGLE = Partition(None, 0, 1)
partitions: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def partition_of(group) -> Partition:
    """The Partition of a user's group, made on its first use (a collective
    call of the group's ranks, as every checkpoint of it is)."""
    if group is None:
        return SINGLE
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(error("group= needs torch.distributed; call torch.distributed.init_process_group() "
                                  "first, or pass group=None to keep whole checkpoints"))
    if group not in partitions:
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(error(f"this rank (global rank {dist.get_rank()}) is not in the group "
                                    f"(ranks {dist.get_process_group_ranks(group)}); pass the model-parallel "
                                    "group this rank belongs to"))
        world = dist.get_world_size(group)
        own = private_group(group) if world > 1 else None
        partitions[group] = Partition(own, rank, world)
    return partitions[group]


numbers = itertools.count()  # names checkpoints in the backend's buffers and declared accesses


class Stash:
    """The checkpoint's tensors as this rank keeps them: its slice of each,
    one after another in one byte segment (each slice padded to ALIGN
    bytes) of its backend's memory, on the tensors' device or, offloaded,
    in pinned host memory. bring_back() starts copying an offloaded segment
    back to the device, fetch() starts bringing every rank's segment back
    (the copy, then the all-gather), inputs() waits for it and rebuilds the
    tensors."""

    def __init__(self, tensors, partition: Partition, offload, contiguous: bool, home: Home):
        self.partition, self.home = partition, home
        self.name = f"checkpoint {next(numbers)}"
        self.meta = [(t.shape, t.dtype, t.requires_grad) for t in tensors]
        self.device = tensors[0].device
        world = partition.world
        # Per tensor: bytes a rank keeps, a multiple of ALIGN and of the element size.
        self.slice_bytes = [-(-(-(-t.numel() // world) * t.element_size()) // ALIGN) * ALIGN for t in tensors]
        self.nbytes = sum(self.slice_bytes)
        self.whole_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.offloaded = offload == "cpu"
        kind = "host_pinned" if self.offloaded else "device"
        self.arena = home.arenas[kind] if contiguous else None
        what = f"slices of {self.name}"
        self.segment = self.arena.take(self.nbytes, what) if contiguous else \
            allocate(home.backend, kind, self.nbytes, what)
        self._write_slices(tensors)
        self.landing = self.landed = None  # offloaded: the device buffer it comes back to, and the copy's event
        self.pending = None  # (all-gather work or None, the gathered bytes) once fetch() ran
        self.released = False
        live.append(self)
        usage.add(self.nbytes, self.whole_bytes)

    def _write_slices(self, tensors):
        """The slices into the segment: written there by torch on the
        compute stream, or, offloaded, packed into a device buffer there and
        copied down on the copy stream once the compute stream packed them."""
        backend, compute = self.home.backend, self.home.compute()
        packing = self.home.offload_buffers.take(self.nbytes, compute) if self.offloaded else None
        target = self.segment if packing is None else packing[:self.nbytes]
        backend.declare_access(compute, floats(target), "write", f"{self.name} writes its slices")
        offset = 0
        for t, nbytes in zip(tensors, self.slice_bytes):
            mine = self._my_slice(t.detach().reshape(-1), nbytes // t.element_size())
            target[offset:offset + mine.numel() * t.element_size()].view(t.dtype).copy_(mine)
            offset += nbytes
        if packing is not None:
            stream = self.home.copy_stream()
            backend.wait(stream, backend.record(compute))
            backend.copy(stream, floats(self.segment), floats(target))
            self.home.offload_buffers.give_back(packing, backend.record(stream))

    def _my_slice(self, flat: torch.Tensor, per_rank: int) -> torch.Tensor:
        start = min(self.partition.rank * per_rank, flat.numel())
        return flat[start:min(start + per_rank, flat.numel())]

    def _refuse_released(self):
        if self.released:
            raise RuntimeError(error("this checkpoint was already backpropagated through and released; "
                                      "backward through a zerocore.checkpoint runs once (retain_graph is not "
                                      "supported)"))

    def bring_back(self):
        """Starts copying an offloaded segment back to a device buffer on
        the copy stream, once (after the copy down: the same stream);
        nothing for one kept on the device."""
        if not self.offloaded or self.landed is not None:
            return
        self._refuse_released()
        backend, stream = self.home.backend, self.home.copy_stream()
        self.landing = self.home.offload_buffers.take(self.nbytes, stream)
        backend.copy(stream, floats(self.landing[:self.nbytes]), floats(self.segment))
        self.landed = backend.record(stream)

    def fetch(self):
        """Starts bringing the checkpoint back to its device and gathering it,
        once; asynchronous where the device allows."""
        if self.pending is not None:
            return
        self._refuse_released()
        backend, compute = self.home.backend, self.home.compute()
        local = self.segment
        if self.offloaded:
            self.bring_back()
            # A stream wait: what reads the copy (the gather, issued in the
            # compute stream's order, and the recomputation) comes after it.
            backend.wait(compute, self.landed)
            local = self.landing[:self.nbytes]
        part = self.partition
        if part.world == 1:
            self.pending = (None, local)
            return
        backend.declare_access(compute, floats(local), "read", f"all-gather of {self.name}")
        gathered = torch.empty(part.world * self.nbytes, dtype=torch.uint8, device=self.device)
        work = all_gather_single(gathered, local, group=part.gather_group, async_op=True)
        self.pending = (work, gathered)

    def inputs(self) -> list:
        """The checkpoint's tensors, whole, on their device (fetching them if
        no prefetch did)."""
        self.fetch()
        work, gathered = self.pending
        if work is not None:
            work.wait()
        else:  # rebuilt as views of the segment (or its copy back): the recomputation reads it
            self.home.backend.declare_access(self.home.compute(), floats(gathered), "read",
                                             f"{self.name}'s recomputation")
        rows = gathered.view(self.partition.world, self.nbytes)
        out, offset = [], 0
        for (shape, dtype, requires_grad), nbytes in zip(self.meta, self.slice_bytes):
            whole = rows[:, offset:offset + nbytes].contiguous().view(-1).view(dtype)
            out.append(whole[:shape.numel()].view(shape).requires_grad_(requires_grad))
            offset += nbytes
        return out

    def release(self):
        """Gives the slices back; idempotent (backward and the checkpoint's
        finalizer both call it)."""
        if self.released:
            return
        self.released = True
        if self.pending is not None and self.pending[0] is not None:
            self.pending[0].wait()  # the collective must not outlive the buffers it reads
        if self.landing is not None:
            # Its last use: the copy back, or, once fetched, the gather and the
            # recomputation on the compute stream (which waited for the copy).
            last_use = self.landed if self.pending is None else self.home.backend.record(self.home.compute())
            self.home.offload_buffers.give_back(self.landing, last_use)
        self.pending = self.segment = self.landing = None
        live.remove(self)
        if self.arena is not None:
            self.arena.give_back()
            self.arena = None  # a graph kept after backward keeps the stash, not the buffer
        usage.remove(self.nbytes, self.whole_bytes)

    def previous(self):
        """The live stash made just before this one: the next checkpoint that
        backward will reach."""
        i = live.index(self)
        return live[i - 1] if i > 0 else None
