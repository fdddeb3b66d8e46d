"""FlatGroup: the params of one unit that share trainability, laid out in
one flat buffer by the native planner, and everything the engine keeps for
them on this rank.

Layout (zerocore.LayoutPlan): params in backward order, aligned, cut into
constant-size buckets that split evenly over the partition ranks; rank r
owns block r of every bucket, and its partition is those blocks end to end.
What lives where, per stage (placement.py; P: partition, F: full flat buffer):

    stage   params (dtype)      grads (reduce dtype)   fp32 master, states
    0       F, replicated       F, all-reduced         F (world size 1 plan)
    1       F, all-gathered     F, reduce-scattered    P
    2       F, all-gathered     P (staged buckets)     P
    3       P shard; F only     P (staged buckets)     P
            while gathered

The module's nn.Parameters keep their identity; their .data are views into
F, created once. A sharded group has no F of its own: stage 3's schedule
gathers its unit into a buffer of the native gather pool and binds the
params to views of it (bind), and points them back at placeholders of their
shape that hold one NaN when the unit is released (unbind), so a stale read
gives NaNs instead of another unit's values, and a write raises
(param_guards.py).
"""
from __future__ import annotations

import dataclasses

import torch

import zerocore
from zerocore import param_guards
from zerocore.comm import Communicator

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NATIVE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
ALIGN_BYTES = 64  # params and shards start on cache lines


def arena_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed 1-D tensor in its own native arena (huge pages when large),
    resident only once written: optimizer state and grads cost no memory
    from wrap until the first step uses them."""
    return zerocore.to_torch(zerocore.zeros([numel], NATIVE_NAMES[dtype]))


@dataclasses.dataclass(frozen=True)
class Run:
    """A stretch of this rank's partition inside one bucket whose params all
    belong to one optimizer group: the unit of a native optimizer call."""

    bucket: int
    group: int
    part: slice  # in the partition
    flat: slice  # in the flat buffer


class FlatGroup:
    def __init__(self, params, names, opt_groups, *, placement, dtype, reduce_dtype, trainable, sharded,
                 bucket_bytes, comm: Communicator, state_names=(), delayed=False):
        self.params = params  # backward order
        self.names = names  # per param: every name it has in the module
        self.shapes = [p.shape for p in params]
        self.placement = placement
        self.dtype = dtype
        self.reduce_dtype = reduce_dtype
        self.trainable = trainable
        self.sharded = sharded
        self.comm = comm
        self.tag = None  # set by the engine: this group's index, the same on every rank (the collectives' key)
        self.partitioned = placement.partitions_optimizer
        world = comm.world_size if self.partitioned else 1
        self.rank = comm.rank if self.partitioned else 0
        elem = torch.finfo(dtype).bits // 8
        self.plan = zerocore.LayoutPlan.make(
            [p.numel() for p in params], groups=opt_groups, world_size=world,
            align_elems=ALIGN_BYTES // elem, bucket_elems=max(1, bucket_bytes // elem))
        # The plan's lists, converted from native once.
        self.slots = self.plan.params
        self.buckets = self.plan.buckets
        # This rank's stretches of the params, in partition order.
        self.segments = list(self.plan.segments(self.rank))
        self._segments_of = [[] for _ in params]
        for seg in self.segments:
            self._segments_of[seg.param].append(seg)
        self.runs = self._runs() if trainable else []
        self.state_names = state_names
        self.delayed = delayed
        self.full = None  # F; for a sharded group, the buffer it is bound to while gathered
        self._views = {}  # sharded: per buffer address, the params' views into it
        self._placeholders = []
        self._grad_placeholders = None  # made by hide_grads, once
        self._grads_zeroed = False  # zero_grad zeroed the grad buffers since the last backward
        self._versions = []  # the params' version counters as carry_param_writes last saw them
        self.shard = None
        self.master = None
        self.state = {}
        self.grad_full = None
        self.grad_part = None
        # Offload: the grads the host step reads (grad_part where reduction
        # leaves them on the host and nothing else needs it), and its 16-bit
        # output, copied up to the params training reads.
        self.host_grad = None
        self.host_param = None

    # Layout --------------------------------------------------------------
    def _runs(self):
        runs = []
        for seg in self.segments:
            last = runs[-1] if runs else None
            if last and last.bucket == seg.bucket and last.group == seg.group:
                runs[-1] = Run(seg.bucket, seg.group, slice(last.part.start, seg.partition_offset + seg.numel),
                               slice(last.flat.start, seg.flat_offset + seg.numel))
            else:
                runs.append(Run(seg.bucket, seg.group, slice(seg.partition_offset, seg.partition_offset + seg.numel),
                                slice(seg.flat_offset, seg.flat_offset + seg.numel)))
        return runs

    def shard_slice(self, bucket: int) -> slice:
        lo = self.plan.shard_offset(bucket, self.rank)
        return slice(lo, lo + self.plan.shard_elems(bucket))

    def partition_slice(self, bucket: int) -> slice:
        lo = self.plan.partition_offset(bucket)
        return slice(lo, lo + self.plan.shard_elems(bucket))

    def bucket_slice(self, bucket: int) -> slice:
        b = self.buckets[bucket]
        return slice(b.offset, b.offset + b.numel)

    def partition_from_flat(self, flat: torch.Tensor, out: torch.Tensor):
        for b in range(len(self.buckets)):
            out[self.partition_slice(b)].copy_(flat[self.shard_slice(b)])

    # Allocation and initial values --------------------------------------
    def buffer_plan(self) -> list:
        """(name, category, where, elements, dtype) of each buffer this group
        holds on this rank; where: "device" (where training runs) or "host".
        A name "state.<x>" is optimizer state x."""
        plan, place, f32 = self.plan, self.placement, torch.float32
        n, rd = plan.partition_elems, self.reduce_dtype
        if self.sharded:
            out = [("shard", "param", "host" if place.params_on_host else "device", n, self.dtype)]
        else:
            out = [("full", "param", "device", plan.total_elems, self.dtype)]
        if not self.trainable:
            return out
        optim_at = "host" if place.optimizer_on_host else "device"
        if self.dtype != f32 or place.optimizer_on_host:
            out.append(("master", "optim", optim_at, n, f32))
        out += [(f"state.{name}", "optim", optim_at, n, f32) for name in self.state_names]
        if place.partitions_grads:
            out.append(("grad_part", "grad", optim_at, n, rd))
        else:
            out.append(("grad_full", "grad", "device", plan.total_elems, rd))
        if place.optimizer_on_host:
            # Stage 1 reduces full grads on the device; a delayed update reads
            # its grads while the next backward accumulates new ones (stages
            # 2-3: into the other of two host buffers, swap_grads).
            if not place.partitions_grads or self.delayed:
                out.append(("host_grad", "grad", "host", n, rd))
            if self.dtype != f32:
                out.append(("host_param", "param", "host", n, self.dtype))
        return out

    def planned_bytes(self, where: str) -> int:
        """Bytes buffer_plan() puts on `where`, before anything is allocated."""
        return sum(n * dtype.itemsize for _, _, at, n, dtype in self.buffer_plan() if at == where)

    def _buffer(self, name: str):
        return self.state.get(name[6:]) if name.startswith("state.") else getattr(self, name)

    def allocate(self):
        """This rank's buffers for the plan, zeroed. No collective: the
        engine checks that every rank allocated before the first one."""
        for name, _, _, numel, dtype in self.buffer_plan():
            t = arena_zeros(numel, dtype)
            if name.startswith("state."):
                self.state[name[6:]] = t
            else:
                setattr(self, name, t)
        if self.trainable and self.placement.optimizer_on_host and self.host_grad is None:
            self.host_grad = self.grad_part

    def fill(self, values_later=frozenset()):
        """Fills the buffers from the params' values, except those of params
        in values_later (ids), which the engine loads afterwards
        (load_param): a model built on the meta device has none yet. Every
        rank starts from rank 0's values, as DDP does; buffers are filled
        straight from the params, with no full-size temporary. Then the
        params become views of the group's buffer."""
        for i, p in enumerate(self.params):
            if id(p) not in values_later:
                self.comm.broadcast(p.data)
                src = p.detach().reshape(-1)
                self.load_param(i, lambda first, n: src[first:first + n])
        if self.sharded:
            self._placeholders = self._make_placeholders()
            self.unbind()
        else:
            self.bind(self.full)

    def param_stretches(self, index: int) -> list:
        """Where param `index` (of self.params) lives on this rank: (first
        element, elements, buffer views they go to): the whole param where
        this rank holds the flat buffer, its stretches of the shard and the
        fp32 master."""
        out = []
        if not self.sharded:
            slot = self.slots[index]
            out.append((0, slot.numel, [self.full[slot.offset:slot.offset + slot.numel]]))
        parts = [t for t in (self.shard, self.master) if t is not None]
        if parts:
            out += [(seg.param_offset, seg.numel, [t[seg.partition_offset:seg.partition_offset + seg.numel]
                                                   for t in parts]) for seg in self._segments_of[index]]
        return out

    def state_stretches(self, name: str, index: int) -> list:
        """As param_stretches, for optimizer state `name` of param `index`."""
        buf = self.state[name]
        return [(seg.param_offset, seg.numel, [buf[seg.partition_offset:seg.partition_offset + seg.numel]])
                for seg in self._segments_of[index]]

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
        return [(seg.param, seg.param_offset, partition[seg.partition_offset:seg.partition_offset + seg.numel])
                for seg in self.segments]

    # Binding params to a flat buffer ----------------------------------------
    def _make_placeholders(self) -> list:
        """Per param, a tensor of its shape that reads as NaN everywhere: one
        NaN element repeated by zero strides. A read of a released param
        outside its unit's forward and backward (model.state_dict(),
        printing a weight) gives NaNs instead of another unit's values or
        a crash, and a write raises, since every element is one location."""
        nan = torch.full((1,), float("nan"), dtype=self.dtype)
        return [nan.expand(shape) for shape in self.shapes]

    @property
    def gathered(self) -> bool:
        return self.full is not None

    def bind(self, flat: torch.Tensor, keep_views=True):
        """The params become views of `flat`, this group's flat buffer (for a
        sharded group, where its unit is gathered). keep_views: the buffer
        lives as long as the engine (a pool slot), so its views are made once
        and kept; a temporary buffer's are not, or they would keep it alive."""
        views = self._views.get(flat.data_ptr())
        if views is None:
            views = [flat[s.offset:s.offset + s.numel].view(shape) for s, shape in zip(self.slots, self.shapes)]
            if keep_views:
                self._views[flat.data_ptr()] = views
        for p, v in zip(self.params, views):
            param_guards.restore(p, v)
        self.full = flat

    def unbind(self):
        """Sharded: the params point at placeholders with no memory again,
        and refuse writes (param_guards.release)."""
        for p, v, names in zip(self.params, self._placeholders, self.names):
            param_guards.release(p, v, names[0])
        self.full = None

    # Gradients -------------------------------------------------------------
    def attach_grad_views(self):
        """Stages 0-1: each param's .grad is its view into the flat grad
        buffer, so autograd accumulates in place. The placeholder hide_grads
        left stands for the grads the buffer holds; a grad the user set to
        None counts as zero; one they replaced is taken over."""
        hidden = self._grad_placeholders or [None] * len(self.params)
        for p, slot, shape, placeholder in zip(self.params, self.slots, self.shapes, hidden):
            view = self.grad_full[slot.offset:slot.offset + slot.numel].view(shape)
            if p.grad is None:
                if not self._grads_zeroed:
                    view.zero_()
            elif p.grad is not placeholder and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view
        self._grads_zeroed = False

    def hide_grads(self):
        """After backward: each param's .grad becomes a placeholder that
        raises on use (param_guards.GradPlaceholder), since what autograd
        left there is not the grad the step applies."""
        if self._grad_placeholders is None:
            self._grad_placeholders = [param_guards.GradPlaceholder.of(p, self.placement.stage, names[0])
                                       for p, names in zip(self.params, self.names)]
        for p, placeholder in zip(self.params, self._grad_placeholders):
            p.grad = placeholder

    def drop_hidden_grads(self):
        """.grad is None again where it is hide_grads' placeholder."""
        for p, placeholder in zip(self.params, self._grad_placeholders or ()):
            if p.grad is placeholder:
                p.grad = None

    def zero_grad(self):
        """Zeroes the grad buffers; the params' .grad are None."""
        for g in (self.grad_full, self.grad_part):
            if g is not None:
                g.zero_()
        for p in self.params:
            p.grad = None
        self._grads_zeroed = True

    def owned_grad(self, run: Run) -> torch.Tensor:
        return self.grad_full[run.flat] if self.grad_full is not None else self.grad_part[run.part]

    # Optimizer -------------------------------------------------------------
    def live(self, run: Run) -> torch.Tensor:
        """The run's stretch of the params training reads."""
        return self.shard[run.part] if self.sharded else self.full[run.flat]

    def run_views(self) -> list:
        """Per run of this rank's partition, the views a native step updates:
        (param group, fp32 param, grad, state0, state1, 16-bit param copy).
        Offloaded, they are the host's: its grads, and its own 16-bit copy
        (offload_copies says where they go). They never move, so the engine
        converts them once."""
        states = list(self.state.values()) + [None, None]
        out = []
        for run in self.runs:
            if self.placement.optimizer_on_host:
                copy = self.host_param[run.part] if self.host_param is not None else None
                param, grad = self.master[run.part], self.host_grad[run.part]
            elif self.master is not None:
                param, grad, copy = self.master[run.part], self.owned_grad(run), self.live(run)
            else:
                param, grad, copy = self.live(run), self.owned_grad(run), None
            out.append((run.group, param, grad, *(s[run.part] if s is not None else None for s in states[:2]), copy))
        return out

    @property
    def swaps_grads(self) -> bool:
        """Offloaded with a delayed update at stages 2-3: reduction fills one
        host grad buffer while the update reads the other, and at each step
        they trade places (swap_grads) instead of being copied."""
        return self.placement.partitions_grads and self.host_grad is not None and self.host_grad is not self.grad_part

    def swap_grads(self):
        self.grad_part, self.host_grad = self.host_grad, self.grad_part

    def offload_copies(self, run: Run) -> tuple:
        """Offloaded: the run's (grads down, params up) copies, as (source,
        destination) pairs, and its spare host grad: the reduced grads into
        the host's (none where reduction leaves them there), the host step's
        new params (its 16-bit copy, or the fp32 master) into the params
        training reads, and the buffer reduction fills where the two swap
        (None elsewhere)."""
        spare = self.grad_part[run.part] if self.swaps_grads else None
        down = [] if self.host_grad is self.grad_part or spare is not None \
            else [(self.owned_grad(run), self.host_grad[run.part])]
        new = self.host_param if self.host_param is not None else self.master
        return down, [(new[run.part], self.live(run))], spare

    # Whole-model views -----------------------------------------------------
    def fp32_partition(self) -> torch.Tensor:
        """This rank's partition of the params in fp32 (the master if any)."""
        if self.master is not None:
            return self.master
        if self.sharded:
            return self.shard.float()
        out = torch.empty(self.plan.partition_elems, dtype=torch.float32)
        self.partition_from_flat(self.full, out)  # block by block: no full-size fp32 temporary
        return out

    def full_fp32(self) -> torch.Tensor:
        """The whole flat buffer in fp32, on every rank (uncounted gather)."""
        part = self.fp32_partition()
        world, plan = self.plan.world_size, self.plan
        if world == 1:
            return part
        parts = torch.empty(world * plan.partition_elems, dtype=torch.float32)
        self.comm.all_gather(parts, part, (self.tag, -1), count=False)
        flat = torch.empty(plan.total_elems, dtype=torch.float32)
        for r in range(world):
            for b in range(len(self.buckets)):
                lo, n = plan.shard_offset(b, r), plan.shard_elems(b)
                src = r * plan.partition_elems + plan.partition_offset(b)
                flat[lo:lo + n].copy_(parts[src:src + n])
        return flat

    def write_back(self, before: torch.Tensor):
        """After the user edited params in place (gathered_params): carry the
        elements of this rank's blocks that changed into the shard and the
        fp32 master, leaving unchanged elements' master precision intact."""
        now = torch.empty_like(before)
        self.partition_from_flat(self.full, now)
        changed = now != before
        if self.sharded:
            self.shard.copy_(now)
        if self.master is not None:
            self.master[changed] = now[changed].float()
        self.note_param_versions()

    def note_param_versions(self):
        """The params' values as they are now are the engine's own (wrap's
        initialisation wrote through them too): writes through them from
        here on are the user's (carry_param_writes)."""
        self._versions = [p._version for p in self.params]

    def carry_param_writes(self):
        """Params held whole that the user wrote in place since the last
        call (model.load_state_dict, p.fill_, nn.init.*): this rank's
        stretches of them go to the fp32 master, which the step updates and
        which would otherwise give the old values back. The params' version
        counters, which only writes through the param itself advance, tell
        which were written."""
        if self.sharded or self.master is None:
            return
        for i, p in enumerate(self.params):
            if p._version != self._versions[i]:
                for seg in self._segments_of[i]:
                    self.master[seg.partition_offset:seg.partition_offset + seg.numel].copy_(
                        self.full[seg.flat_offset:seg.flat_offset + seg.numel])
                self._versions[i] = p._version

    def snapshot_partition(self) -> torch.Tensor:
        out = torch.empty(self.plan.partition_elems, dtype=self.dtype)
        self.partition_from_flat(self.full, out)
        return out

    # Accounting ------------------------------------------------------------
    def memory(self, where=None) -> dict:
        """Bytes this group holds per category, on `where` ("device" or
        "host"; None: both). A sharded group holds its shard; the buffers it
        is gathered into belong to the schedule's pool (the engine's
        comm_buffers)."""
        out = {"param": 0, "grad": 0, "optim": 0}
        for name, category, at, _, _ in self.buffer_plan():
            t = self._buffer(name)
            if t is not None and where in (None, at):
                out[category] += t.numel() * t.element_size()
        return out

    @property
    def label(self) -> str:
        """The group's params, for messages."""
        first, last = self.names[-1][0], self.names[0][0]  # registration order
        frozen = "" if self.trainable else "frozen "
        return f"the {frozen}params {first}" + (f" .. {last}" if len(self.names) > 1 else "")
