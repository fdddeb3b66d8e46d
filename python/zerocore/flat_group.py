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

The module's nn.Parameters keep their identity; their .data are views into
F, created once. A sharded group has no F of its own: stage 3's schedule
gathers its unit into a buffer of the native gather pool and binds the
params to views of it (bind), and points them back at placeholders of their
shape that hold one NaN when the unit is released (unbind), so a stale read
gives NaNs instead of another unit's values, and a write raises
(param_guards.py).
"""
from __future__ import annotations

import torch

import zerocore
from zerocore import param_guards
from zerocore.comm import Communicator

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NATIVE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
FROM_NATIVE = {name: dtype for dtype, name in NATIVE_NAMES.items()}
ALIGN_BYTES = 64  # params and shards start on cache lines


class FlatGroup:
    """comm: the Communicator whose world size and rank the group is
    partitioned over, and on whose backend its store lives."""

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
        self.store = zerocore.PartitionStore(
            self.plan, backend=comm.backend, rank=self.rank, dtype=NATIVE_NAMES[dtype],
            reduce_dtype=NATIVE_NAMES[reduce_dtype], trainable=trainable, sharded=sharded,
            partitions_grads=placement.partitions_grads,
            params_on_host=placement.params_on_host, optimizer_on_host=placement.optimizer_on_host,
            delayed=delayed, state_names=list(state_names),
            name=f"the flat group of {names[0][0]}" if names else "an empty flat group")
        # The plan's and the store's lists, converted from native once.
        self.slots = self.plan.params
        self.buckets = self.plan.buckets
        self.segments = self.store.segments  # this rank's pieces of the params, in partition order
        self.runs = self.store.runs  # their runs, for the optimizer (PartitionRun)
        self.state_names = state_names
        self.delayed = delayed
        self.full = None  # F; for a sharded group, the buffer it is bound to while gathered
        self._views = {}  # sharded: per buffer address, the params' views into it
        self._placeholders = []
        self._grad_views = None  # per param, its view of grad_full: made once
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

    # Layout ---------------------------------------------------------------
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

    # Allocation and initial values --------------------------------------
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
        if self.store.has("host_grad") and self.host_grad is None:
            self.host_grad = self.grad_part  # the host step reads its grads where reduction leaves them

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

    # Binding params to a flat buffer ----------------------------------------
    def _make_placeholders(self) -> list:
        """Per param, a tensor of its shape that reads as NaN everywhere: one
        NaN element repeated by zero strides. A read of a released param
        outside its unit's forward and backward (model.state_dict(),
        printing a weight) gives NaNs instead of another unit's values or
        a crash, and a write raises, since every element is one location."""
        nan = torch.full((1,), float("nan"), dtype=self.dtype, device=self.params[0].device)  # where training runs
        return [nan.expand(shape) for shape in self.shapes]

    @property
    def gathered(self) -> bool:
        return self.full is not None

    def bind(self, flat: torch.Tensor, keep_views=True):
        """The params become views of `flat`, this group's flat buffer (for a
        sharded group, where its unit is gathered). keep_views: the buffer
        lives as long as the engine (a pool slot), so its views are made once
        and kept; a temporary buffer's are not, or they would keep it alive."""
        for p, v in zip(self.params, self._param_views(flat, keep_views)):
            param_guards.restore(p, v)
        self.full = flat

    def _param_views(self, flat: torch.Tensor, keep=True) -> list:
        """Per param, its view of `flat` (see bind for keep)."""
        views = self._views.get(flat.data_ptr())
        if views is None:
            views = [self.view(flat, "param", i).view(shape) for i, shape in enumerate(self.shapes)]
            if keep:
                self._views[flat.data_ptr()] = views
        return views

    def take_rebound(self, keep_views=True) -> list:
        """Params bound to self.full whose .data the user rebound since
        (`p.data = t`, `p.set_(t)`): their values go into their place in
        self.full, as an in-place write's would, and they view it again, so
        training, which reads and updates self.full, goes on from them.
        Returns their indices. A new shape or dtype raises: the layout was
        planned at wrap."""
        rebound = []
        for i, (p, view, names) in enumerate(zip(self.params, self._param_views(self.full, keep_views), self.names)):
            if param_guards.same_binding(p, view):
                continue
            if p.shape != view.shape or p.dtype != view.dtype:
                raise RuntimeError(
                    f"zerocore: {names[0]}.data was set to a tensor of shape {tuple(p.shape)} and dtype {p.dtype} "
                    f"after zerocore.wrap, which laid this param out as shape {tuple(view.shape)} and dtype "
                    f"{view.dtype}. To set its values, assign a tensor of that shape and dtype (`p.data = "
                    f"t.to({view.dtype})`) or write them in place (`p.copy_(t)` under torch.no_grad()); to change its "
                    "shape or dtype: model = engine.close(), change it, and wrap the model again.")
            values = p.detach()
            if values.untyped_storage().data_ptr() == view.untyped_storage().data_ptr():
                # It views the engine's buffer too (p.data = p.data.t()): copy_ must not read what it writes.
                values = values.clone()
            view.copy_(values)
            param_guards.restore(p, view)
            rebound.append(i)
        return rebound

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
        for i, (p, placeholder) in enumerate(zip(self.params, hidden)):
            view = self.grad_view(i)
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

    def grad_view(self, index: int) -> torch.Tensor:
        """Stages 0-1: param `index`'s grad in the flat grad buffer, shaped as the param."""
        if self._grad_views is None:
            self._grad_views = [self.view("grad_full", "param", i).view(shape)
                                for i, shape in enumerate(self.shapes)]
        return self._grad_views[index]

    # Optimizer -------------------------------------------------------------
    def _run_view(self, kind, run: int):
        return self.view(kind, "run", run) if kind is not None else None

    @property
    def _live(self) -> str:
        """The kind of the params training reads."""
        return "shard" if self.sharded else "full"

    @property
    def _owned_grad(self) -> str:
        """The kind of the grads reduction leaves."""
        return "grad_full" if self.grad_full is not None else "grad_part"

    def run_views(self) -> list:
        """Per run of this rank's partition, the views a native step updates:
        (param group, fp32 param, grad, state0, state1, 16-bit param copy).
        Offloaded, they are the host's: its grads, and its own 16-bit copy
        (offload_copies says where they go). They never move, so the engine
        converts them once."""
        states = [f"state.{name}" for name in self.state] + [None, None]
        if self.placement.optimizer_on_host:
            param, grad, copy = "master", "host_grad", "host_param" if self.host_param is not None else None
        elif self.master is not None:
            param, grad, copy = "master", self._owned_grad, self._live
        else:
            param, grad, copy = self._live, self._owned_grad, None
        return [(run.group, *(self._run_view(kind, k) for kind in (param, grad, *states[:2], copy)))
                for k, run in enumerate(self.runs)]

    @property
    def swaps_grads(self) -> bool:
        """Offloaded with a delayed update at stages 2-3: reduction fills one
        host grad buffer while the update reads the other, and at each step
        they trade places (swap_grads) instead of being copied."""
        return self.store.swaps_grads

    def swap_grads(self):
        self.store.swap_grads()
        self.grad_part, self.host_grad = self.host_grad, self.grad_part

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

    # Whole-model views -----------------------------------------------------
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

    def write_back(self, before: torch.Tensor):
        """After the user edited params in place (gathered_params): carry the
        elements of this rank's blocks that changed into the shard and the
        fp32 master, leaving unchanged elements' master precision intact."""
        self.take_rebound(keep_views=not self.sharded)  # a sharded group's gathered buffer is a temporary
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
        """Params held whole that the user wrote since the last call, in
        place (model.load_state_dict, p.fill_, nn.init.*) or by rebinding
        their .data (take_rebound): this rank's stretches of them go to the
        fp32 master, which the step updates and which would otherwise give
        the old values back. The params' version counters, which only
        writes through the param itself advance, tell which were written in
        place."""
        if self.sharded:
            return
        rebound = set(self.take_rebound())
        if self.master is None:
            return
        for i, p in enumerate(self.params):
            if p._version != self._versions[i] or i in rebound:
                for seg in self.store.segments_of(i):
                    self.view("master", "segment", seg).copy_(self.view("full", "segment", seg))
                self._versions[i] = p._version

    def snapshot_partition(self) -> torch.Tensor:
        out = torch.empty(self.plan.partition_elems, dtype=self.dtype, device=self.full.device)
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
