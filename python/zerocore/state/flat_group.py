"""FlatGroup: the params of one unit that share trainability, laid out in
one flat buffer by the native planner, and everything the engine keeps for
them on this rank.

Layout (zerocore.LayoutPlan): params in backward order, aligned, cut into
constant-size buckets that split evenly over the partition ranks; rank r
owns block r of every bucket, and its partition is those blocks end to end.
The native partition store (zerocore.PartitionStore) keeps the buffers and
hands out every view into them, by (param, kind), (bucket, kind) or
(run, kind): no offset is computed here.
What lives where, per stage (placement.py; P: partition, F: full flat buffer):

    stage   params (dtype)      grads (reduce dtype)   fp32 master, states
    0       F, replicated       F, all-reduced         F (world size 1 plan)
    1       F, all-gathered     F, reduce-scattered    P
    2       F, all-gathered     P (staged buckets)     P
    3       P shard; F only     P (staged buckets)     P
            while gathered

A FlatGroup holds the plan, the store and `buffers`, the store's buffers
by kind ("full", "shard", "master", "grad_full", "grad_part", "host_grad",
"host_param", "state.<name>" for optimizer state <name>, "grad_sums"),
and reads through them by layout (views.py's functions). Its part
`binder` (binding.py, ParamBinder) binds the module's params and .grad to
them; the buffer the params view now is the binder's `bound`.
"""
from __future__ import annotations

import torch

import zerocore
from zerocore.comm.communicator import Communicator
from zerocore.state import views
from zerocore.state.binding import ParamBinder

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NATIVE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
FROM_NATIVE = {name: dtype for dtype, name in NATIVE_NAMES.items()}
ALIGN_BYTES = 64  # params and shards start on cache lines
STATE = "state."  # the store's kinds of optimizer state: "state.<name>"


class FlatGroup:
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
        # The store's buffers by kind, as torch tensors (allocate; the binder reads the same dict). Offloaded
        # with the host step reading its grads where reduction leaves them,
        # "host_grad" is "grad_part"; with exact sums, "grad_sums" is
        # grad_part's memory as int40, n x 5 bytes (partition_store.h).
        self.buffers: dict[str, torch.Tensor] = {}
        self.binder = ParamBinder(params, names, dtype=dtype, stage=placement.stage, sharded=sharded,
                                  store=self.store, buffers=self.buffers, rank=self.rank)

    # Buffers ----------------------------------------------------------------
    def buffer_plan(self) -> list:
        """(kind, category, where, elements, dtype) of each buffer this group
        holds on this rank (the store's plan, partition_store.h); where:
        "device" (where training runs) or "host". A kind "state.<x>" is
        optimizer state x."""
        return [(kind, category, where, n, FROM_NATIVE[dtype])
                for kind, category, where, n, dtype in self.store.buffers]

    def planned_bytes(self, where: str) -> int:
        """Bytes buffer_plan() puts on `where`, before anything is allocated."""
        return self.store.planned_bytes(where)

    def allocate(self):
        """This rank's buffers for the plan, zeroed. No collective: the
        engine checks that every rank allocated before the first one."""
        self.store.allocate()
        self.buffers.update({kind: torch.from_dlpack(self.store.buffer(kind)) for kind, *_ in self.store.buffers})
        if self.store.has("grad_sums"):
            self.buffers["grad_sums"] = torch.from_dlpack(self.store.buffer("grad_sums"))
        if self.store.has("host_grad") and "host_grad" not in self.buffers and "grad_part" in self.buffers:
            self.buffers["host_grad"] = self.buffers["grad_part"]  # the host step reads its grads where they land

    def optimizer_states(self) -> dict:
        """Optimizer state name -> this rank's buffer of it."""
        return {kind[len(STATE):]: t for kind, t in self.buffers.items() if kind.startswith(STATE)}

    @property
    def swaps_grads(self) -> bool:
        """Offloaded with a delayed update at stages 2-3: reduction fills one
        host grad buffer while the update reads the other, and at each step
        they trade places (EngineCore.follow_swaps) instead of being copied."""
        return self.store.swaps_grads

    def grads_swapped(self):
        """The store swapped grad_part and host_grad (EngineCore.follow_swaps): the views follow."""
        b = self.buffers
        b["grad_part"], b["host_grad"] = b["host_grad"], b["grad_part"]

    # Views by layout ----------------------------------------------------------
    def view(self, buffer, span: str, *args) -> torch.Tensor:
        """views.view of `buffer`: a kind this group holds ("master",
        "state.exp_avg", ...) or a whole or partition-sized tensor of its plan."""
        return views.view(self.store, self.buffers[buffer] if isinstance(buffer, str) else buffer, span, *args)

    def param_stretches(self, index: int) -> list:
        """Where param `index` (of self.params) lives on this rank
        (views.stretches): the whole param where this rank holds the flat
        buffer, its stretches of the shard and the fp32 master."""
        out = [] if self.sharded else views.stretches(self.store, [self.buffers["full"]], index)
        parts = [self.buffers[kind] for kind in ("shard", "master") if kind in self.buffers]
        return out + (views.stretches(self.store, parts, index) if parts else [])

    def state_stretches(self, name: str, index: int) -> list:
        """As param_stretches, for optimizer state `name` of param `index`."""
        return views.stretches(self.store, [self.buffers[STATE + name]], index)

    def load_param(self, index: int, read):
        """Sets param `index` on this rank from read (views.load)."""
        views.load(self.param_stretches(index), read)

    def owned_stretches(self, partition: torch.Tensor) -> list:
        """views.owned_stretches of this rank's partition `partition`."""
        return views.owned_stretches(self.store, self.segments, partition)

    # Filling ------------------------------------------------------------------
    def fill(self, values_later=frozenset()):
        """Fills the buffers from the params' values, except those of params
        in values_later (ids), which the engine loads afterwards
        (load_param): a model built on the meta device has none yet. Every
        rank starts from rank 0's values, as DDP does; buffers are filled
        straight from the params, with no full-size temporary. Then the
        params are bound to the buffers (ParamBinder.bind_initial)."""
        for i, p in enumerate(self.params):
            if id(p) not in values_later:
                self.comm.broadcast(p.data)
                src = p.detach().reshape(-1)
                self.load_param(i, lambda first, n: src[first:first + n])
        self.binder.bind_initial()

    # The step's runs and offload's copies -----------------------------------
    def run_views(self) -> list:
        """Per run of this rank's partition, the views a native step updates:
        (param group, fp32 param, grad, state0, state1, 16-bit param copy),
        as the native store picks them (PartitionStore::flat_runs, which a
        C++ embedder's step takes too): DLPack arrays, None where there is
        none. Offloaded, they are the host's: its grads, and its own 16-bit
        copy (offload_copies says where they go). They never move, so the
        engine converts them once (ops.FlatRuns)."""
        return self.store.flat_runs()

    def _run_view(self, kind: str, run: int):
        return self.view(kind, "run", run) if kind in self.buffers else None

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
            if "grad_full" in self.buffers else []
        new = "host_param" if "host_param" in self.buffers else "master"
        return down, [(self._run_view(new, run), self._run_view("shard" if self.sharded else "full", run))], spare

    # The params whole in fp32 ---------------------------------------------
    def fp32_partition(self) -> torch.Tensor:
        """This rank's partition of the params in fp32 (the master if any)."""
        if "master" in self.buffers:
            return self.buffers["master"]
        if self.sharded:
            return self.buffers["shard"].float()
        full = self.buffers["full"]
        out = torch.empty(self.plan.partition_elems, dtype=torch.float32, device=full.device)
        # Block by block: no full-size fp32 temporary.
        views.partition_from_flat(self.store, len(self.buckets), self.rank, full, out)
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
        views.flat_from_partitions(self.store, len(self.buckets), parts.view(world, -1), flat)
        return flat

    # Accounting ------------------------------------------------------------
    def memory(self, where=None) -> dict:
        """Bytes this group holds per category, on `where` ("device" or
        "host"; None: both). A sharded group holds its shard; the buffers it
        is gathered into belong to the schedule's pool (the engine's
        comm_buffers)."""
        out = {"param": 0, "grad": 0, "optim": 0}
        for kind, category, at, _, _ in self.buffer_plan():
            t = self.buffers.get("grad_sums" if kind == "grad_part" and "grad_sums" in self.buffers else kind)
            if t is not None and where in (None, at):
                out[category] += t.numel() * t.element_size()
        return out

    @property
    def label(self) -> str:
        """The group's params, for messages."""
        first, last = self.names[-1][0], self.names[0][0]  # registration order
        frozen = "" if self.trainable else "frozen "
        return f"the {frozen}params {first}" + (f" .. {last}" if len(self.names) > 1 else "")
