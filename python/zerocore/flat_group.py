"""FlatGroup: the params of one unit that share trainability, laid out in
one flat buffer by the native planner, and everything the engine keeps for
them on this rank.

Layout (zerocore.LayoutPlan): params in backward order, aligned, cut into
constant-size buckets that split evenly over the partition ranks; rank r
owns block r of every bucket, and its partition is those blocks end to end.
The native partition store (zerocore.PartitionStore) keeps the buffers and
hands out every view into them, by (param, kind), (bucket, kind) or
(run, kind): no offset is computed here.
What lives where, per stage (state/placement.py; P: partition, F: full flat buffer):

    stage   params (dtype)      grads (reduce dtype)   fp32 master, states
    0       F, replicated       F, all-reduced         F (world size 1 plan)
    1       F, all-gathered     F, reduce-scattered    P
    2       F, all-gathered     P (staged buckets)     P
    3       P shard; F only     P (staged buckets)     P
            while gathered

A FlatGroup is one object in three files, by concern:

    flat_group.py          the plan, the store and its buffers: allocation,
                           accounting, offload's grad swap
    flat_group_views.py    views into the buffers by layout (LayoutViews):
                           a param's stretches, the step's runs, the params
                           whole in fp32
    flat_group_binding.py  the module's params and .grad bound to the
                           buffers (ParamBinding): bind and release, grad
                           views and placeholders, the user's writes

Mixins rather than parts the group holds: both halves read the same plan,
store and buffers (a binding is a view of the buffers), and the rest of
zerocore calls them on the group (grouping, stage 3, reduction, offload,
loading, checkpoints); parts would hold the group's buffers twice or
forward every call.
"""
from __future__ import annotations

import torch

import zerocore
from zerocore.comm.communicator import Communicator
from zerocore.flat_group_binding import ParamBinding
from zerocore.flat_group_views import LayoutViews

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NATIVE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
FROM_NATIVE = {name: dtype for dtype, name in NATIVE_NAMES.items()}
ALIGN_BYTES = 64  # params and shards start on cache lines

class FlatGroup(ParamBinding, LayoutViews):
    """comm: the Communicator whose world size and rank the group is
    partitioned over, and on whose backend its store lives."""

    def __init__(self, params, names, param_groups, *, placement, dtype, reduce_dtype, trainable, sharded,
                 bucket_bytes, comm: Communicator, state_names=(), delayed=False, exact_sums=False):
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
            [p.numel() for p in params], groups=param_groups, world_size=world,
            align_elems=ALIGN_BYTES // elem, bucket_elems=max(1, bucket_bytes // elem))
        self.store = zerocore.PartitionStore(
            self.plan, backend=comm.backend, rank=self.rank, dtype=NATIVE_NAMES[dtype],
            reduce_dtype=NATIVE_NAMES[reduce_dtype], trainable=trainable, sharded=sharded,
            partitions_grads=placement.partitions_grads,
            params_on_host=placement.params_on_host, optimizer_on_host=placement.optimizer_on_host,
            delayed=delayed, exact_sums=exact_sums, state_names=list(state_names),
            name=f"the flat group of {names[0][0]}" if names else "an empty flat group")
        # The plan's and the store's lists, converted from native once.
        self.slots = self.plan.params
        self.buckets = self.plan.buckets
        self.segments = self.store.segments  # this rank's pieces of the params, in partition order
        self.runs = self.store.runs  # their runs, for the optimizer (PartitionRun)
        self.state_names = state_names
        self.delayed = delayed
        self.full = None  # F; for a sharded group, the buffer it is bound to while gathered
        self._init_binding()
        self.shard = None
        self.master = None
        self.state = {}
        self.grad_full = None
        self.grad_part = None
        self.grad_sums = None  # exact_sums: grad_part's memory as int40, n x 5 bytes (partition_store.h)
        # Offload: the grads the host step reads (grad_part where reduction
        # leaves them on the host and nothing else needs it), and its 16-bit
        # output, copied up to the params training reads.
        self.host_grad = None
        self.host_param = None

    # Buffers ----------------------------------------------------------------
    def buffer_plan(self) -> list:
        """(name, category, where, elements, dtype) of each buffer this group
        holds on this rank (the store's plan, partition_store.h); where:
        "device" (where training runs) or "host". A name "state.<x>" is
        optimizer state x."""
        return [(kind, category, where, n, FROM_NATIVE[dtype])
                for kind, category, where, n, dtype in self.store.buffers]

    def planned_bytes(self, where: str) -> int:
        """Bytes buffer_plan() puts on `where`, before anything is allocated."""
        return self.store.planned_bytes(where)

    def _buffer(self, name: str):
        return self.state.get(name[6:]) if name.startswith("state.") else getattr(self, name)

    def allocate(self):
        """This rank's buffers for the plan, zeroed. No collective: the
        engine checks that every rank allocated before the first one."""
        self.store.allocate()
        for kind, *_ in self.store.buffers:
            t = torch.from_dlpack(self.store.buffer(kind))
            if kind.startswith("state."):
                self.state[kind[6:]] = t
            else:
                setattr(self, kind, t)
        if self.store.has("grad_sums"):
            self.grad_sums = torch.from_dlpack(self.store.buffer("grad_sums"))
        if self.store.has("host_grad") and self.host_grad is None:
            self.host_grad = self.grad_part  # the host step reads its grads where reduction leaves them

    @property
    def swaps_grads(self) -> bool:
        """Offloaded with a delayed update at stages 2-3: reduction fills one
        host grad buffer while the update reads the other, and at each step
        they trade places (EngineCore.follow_swaps) instead of being copied."""
        return self.store.swaps_grads

    def grads_swapped(self):
        """The store swapped grad_part and host_grad (EngineCore.follow_swaps): the views follow."""
        self.grad_part, self.host_grad = self.host_grad, self.grad_part

    # Accounting ------------------------------------------------------------
    def memory(self, where=None) -> dict:
        """Bytes this group holds per category, on `where` ("device" or
        "host"; None: both). A sharded group holds its shard; the buffers it
        is gathered into belong to the schedule's pool (the engine's
        comm_buffers)."""
        out = {"param": 0, "grad": 0, "optim": 0}
        for name, category, at, _, _ in self.buffer_plan():
            t = self.grad_sums if name == "grad_part" and self.grad_sums is not None else self._buffer(name)
            if t is not None and where in (None, at):
                out[category] += t.numel() * t.element_size()
        return out

    @property
    def label(self) -> str:
        """The group's params, for messages."""
        first, last = self.names[-1][0], self.names[0][0]  # registration order
        frozen = "" if self.trainable else "frozen "
        return f"the {frozen}params {first}" + (f" .. {last}" if len(self.names) > 1 else "")
