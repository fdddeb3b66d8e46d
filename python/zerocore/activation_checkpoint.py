"""zerocore.checkpoint: activation checkpoints partitioned across model-parallel
ranks (ZeRO-R's Pa), held on the host if asked (Pa+cpu), in contiguous
buffers (MD).

With tensor (model) parallelism every rank of a model-parallel group computes
the same input for a block, so every rank would hold the same checkpoint.
`checkpoint(fn, *args, group=mp_group)` runs `fn` without keeping its
activations, as torch.utils.checkpoint does, and keeps its inputs (the
checkpoint: what torch's checkpoint keeps too) split across `group`: each
rank keeps its 1/MP slice of every input tensor, padded so that the tensor
splits evenly. Backward all-gathers the slices, restores the RNG state, runs
`fn` again with grad enabled and backpropagates through it; while one
checkpoint recomputes, the gather of the next one in backward order (the
checkpoint made just before it) is already in flight.

Where a checkpoint's slices live:
- contiguous=True: in one flat byte buffer per device (and per offload
  kind), allocated once: the first step (the first forward-backward, from
  the first checkpoint made to the last one released) allocates each slice
  on its own and measures the total; at its end the buffer is allocated at
  that size and every later step carves its slices out of it. A step that
  needs more uses separate allocations for the excess and the buffer grows
  to fit once that step ends. Its size is `buffer_bytes()`, reported by
  `engine.memory_report()["activations"]`.
- contiguous=False: one allocation per checkpoint.
- offload="cpu": a CUDA tensor's slice is copied to pinned host memory on
  a copy stream, and copied back (on that stream, then gathered after it)
  when backward reaches the checkpoint after it, ahead of need. A CPU
  tensor's slice is already in host memory: it goes to a host buffer of its
  own all the same, and backward gathers from there, with nothing to copy
  back; offload moves nothing off a device that is not there.

The gathers run asynchronously (torch.distributed, async_op) on a process
group of the same ranks as `group` but of this module alone, so none waits
behind, or is mistaken for, the model's own collectives. Every rank of the
group must make the same checkpoints in the same order, as model-parallel
ranks do.

Semantics are those of torch.utils.checkpoint's non-reentrant variant where
they can be: keyword arguments, any tensor and non-tensor inputs, inputs
that do not require grad (params used inside `fn` still get grads), tensor
outputs in any tuple/list/dict, RNG state (CPU and CUDA) and autocast
restored for the recomputation. Inside, backward recomputes and
backpropagates through `fn` in one go, as the reentrant variant does, so
the grads of params used inside `fn` accumulate into their .grad during
backward (torch.autograd.grad(loss, params) does not return them), and each
checkpoint backpropagates once (no retain_graph).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import get_device_states, set_device_states

from zerocore.process_group import private_group

OFFLOADS = (None, "cpu")
_ALIGN = 16  # bytes: every slice starts at a multiple, so a byte view of it views any dtype in place
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _error(message: str) -> str:
    return f"zerocore.checkpoint: {message}"


# Process groups --------------------------------------------------------------
class _Partition:
    """The ranks a checkpoint is split over: this rank's place among them and
    the group of this module's own that gathers over them (None for one rank)."""

    def __init__(self, gather_group, rank: int, world: int):
        self.gather_group, self.rank, self.world = gather_group, rank, world


_SINGLE = _Partition(None, 0, 1)
_partitions: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _partition_of(group) -> _Partition:
    """The _Partition of a user's group, made on its first use (a collective
    call of the group's ranks, as every checkpoint of it is)."""
    if group is None:
        return _SINGLE
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(_error("group= needs torch.distributed; call torch.distributed.init_process_group() "
                                  "first, or pass group=None to keep whole checkpoints"))
    if group not in _partitions:
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(_error(f"this rank (global rank {dist.get_rank()}) is not in the group "
                                    f"(ranks {dist.get_process_group_ranks(group)}); pass the model-parallel "
                                    "group this rank belongs to"))
        world = dist.get_world_size(group)
        own = private_group(group) if world > 1 else None
        _partitions[group] = _Partition(own, rank, world)
    return _partitions[group]


# Buffers ---------------------------------------------------------------------
class _Arena:
    """One flat byte buffer for the slices of one step, on one device, reused
    every step. Slices are carved one after another; the space comes back
    all at once, when the step's last checkpoint is released."""

    def __init__(self, device: torch.device, pinned: bool):
        self.device, self.pinned = device, pinned
        self.buffer = None
        self.top = 0  # bytes carved this step
        self.live = 0  # slices carved this step not yet released

    def take(self, nbytes: int) -> torch.Tensor:
        start, self.top = self.top, self.top + nbytes
        self.live += 1
        if self.buffer is not None and self.top <= self.buffer.numel():
            # .data: a view with a version counter of its own, so that writing
            # the next slice does not invalidate this one where autograd saved it.
            return self.buffer.data[start:self.top]
        return _allocate(nbytes, self.device, self.pinned)

    def give_back(self):
        self.live -= 1
        if self.live:
            return
        if self.buffer is None or self.top > self.buffer.numel():  # sized on the first step, grown if outgrown
            self.buffer = None
            self.buffer = _allocate(self.top, self.device, self.pinned)
        self.top = 0


_arenas: dict = {}


def _allocate(nbytes: int, device: torch.device, pinned: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pinned)


def buffer_bytes(offloaded=None) -> int:
    """Bytes of the contiguous checkpoint buffers this process holds (0
    before the first step ends); offloaded: True, only those on the host
    (offload="cpu"), False, only those on the tensors' device."""
    return sum(a.buffer.numel() for (_, off), a in _arenas.items()
               if a.buffer is not None and offloaded in (None, off))


class _Usage:
    """Bytes of checkpoints alive at once, as kept (partitioned) and as they
    would be whole; the peak of the last step that ended."""

    def __init__(self):
        self.kept = self.whole = self.peak_kept = self.peak_whole = 0
        self.last = {"kept": 0, "unpartitioned": 0}

    def add(self, kept: int, whole: int):
        self.kept, self.whole = self.kept + kept, self.whole + whole
        self.peak_kept, self.peak_whole = max(self.peak_kept, self.kept), max(self.peak_whole, self.whole)

    def remove(self, kept: int, whole: int):
        self.kept, self.whole = self.kept - kept, self.whole - whole
        if not _live:
            self.last = {"kept": self.peak_kept, "unpartitioned": self.peak_whole}
            self.peak_kept = self.peak_whole = 0


_usage = _Usage()


def activation_memory() -> dict:
    """This rank's activation-checkpoint memory, in bytes: "buffers", the
    contiguous buffers held (buffer_bytes()); "kept", the most the
    checkpoints of the last finished step held at once on this rank; and
    "unpartitioned", what those checkpoints would have held whole."""
    return {"buffers": buffer_bytes(), **_usage.last}


# The copy stream of the offload path (CUDA only).
_copy_streams: dict = {}


def _copy_stream(device: torch.device):
    if device.type != "cuda":
        return None
    if device not in _copy_streams:
        _copy_streams[device] = torch.cuda.Stream(device)
    return _copy_streams[device]


# One checkpoint's partitioned inputs -------------------------------------------
_live: list = []  # the stashes not yet released, in the order their checkpoints were made


class _Stash:
    """The checkpoint's tensors as this rank keeps them: its slice of each,
    one after another in one byte segment (each slice padded to _ALIGN
    bytes), on the tensors' device or, offloaded, on the host. fetch()
    starts bringing every rank's segment back (copy to the device, all-gather),
    inputs() waits for it and rebuilds the tensors."""

    def __init__(self, tensors, partition: _Partition, offload, contiguous: bool):
        self.partition = partition
        self.meta = [(t.shape, t.dtype, t.requires_grad) for t in tensors]
        self.device = tensors[0].device
        world = partition.world
        # Per tensor: bytes a rank keeps, a multiple of _ALIGN and of the element size.
        self.slice_bytes = [-(-(-(-t.numel() // world) * t.element_size()) // _ALIGN) * _ALIGN for t in tensors]
        self.nbytes = sum(self.slice_bytes)
        self.whole_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.offloaded = offload == "cpu"
        home = torch.device("cpu") if self.offloaded else self.device
        pinned = self.offloaded and self.device.type == "cuda"
        self.arena = None
        if contiguous:
            self.arena = _arenas.setdefault((home, self.offloaded), _Arena(home, pinned))
            self.segment = self.arena.take(self.nbytes)
        else:
            self.segment = _allocate(self.nbytes, home, pinned)
        self._write_slices(tensors)
        self.pending = None  # (all-gather work or None, the gathered bytes) once fetch() ran
        self.released = False
        _live.append(self)
        _usage.add(self.nbytes, self.whole_bytes)

    def _write_slices(self, tensors):
        stream = _copy_stream(self.device) if self.offloaded else None
        with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            if stream:
                stream.wait_stream(torch.cuda.current_stream(self.device))  # the inputs are computed there
            offset = 0
            for t, nbytes in zip(tensors, self.slice_bytes):
                mine = self._my_slice(t.detach().reshape(-1), nbytes // t.element_size())
                dest = self.segment[offset:offset + mine.numel() * t.element_size()].view(t.dtype)
                dest.copy_(mine, non_blocking=stream is not None)
                if stream:
                    mine.record_stream(stream)  # kept from reuse until the copy ran
                offset += nbytes

    def _my_slice(self, flat: torch.Tensor, per_rank: int) -> torch.Tensor:
        start = min(self.partition.rank * per_rank, flat.numel())
        return flat[start:min(start + per_rank, flat.numel())]

    def fetch(self):
        """Starts bringing the checkpoint back to its device and gathering it,
        once; asynchronous where the device allows."""
        if self.pending is not None:
            return
        if self.released:
            raise RuntimeError(_error("this checkpoint was already backpropagated through and released; "
                                      "backward through a zerocore.checkpoint runs once (retain_graph is not "
                                      "supported)"))
        stream = _copy_stream(self.device) if self.offloaded else None
        with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            local = self.segment.to(self.device, non_blocking=True) if stream else self.segment
            part = self.partition
            if part.world == 1:
                self.pending = (None, local)
                return
            gathered = torch.empty(part.world * self.nbytes, dtype=torch.uint8, device=self.device)
            work = dist.all_gather_single(gathered, local, group=part.gather_group, async_op=True)
            if stream:  # used on the compute stream later: not to be reused by the copy stream before
                gathered.record_stream(torch.cuda.current_stream(self.device))
            self.pending = (work, gathered)

    def inputs(self) -> list:
        """The checkpoint's tensors, whole, on their device (fetching them if
        no prefetch did)."""
        self.fetch()
        work, gathered = self.pending
        if work is not None:
            work.wait()
        if self.offloaded and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_stream(_copy_stream(self.device))
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
            self.pending[0].wait()  # the collective must not outlive the buffers it writes
        self.pending = self.segment = None
        _live.remove(self)
        if self.arena is not None:
            self.arena.give_back()
        _usage.remove(self.nbytes, self.whole_bytes)

    def previous(self):
        """The live stash made just before this one: the next checkpoint that
        backward will reach."""
        i = _live.index(self)
        return _live[i - 1] if i > 0 else None


# Recomputation state ----------------------------------------------------------
class _Replay:
    """What the recomputation must see as the forward did: RNG states (CPU
    and the CUDA devices of the inputs) and autocast."""

    def __init__(self, tensors, preserve_rng_state: bool):
        self.preserve = preserve_rng_state
        if preserve_rng_state:
            self.cpu_rng = torch.get_rng_state()
            self.devices, self.device_rngs = get_device_states(*tensors)
        devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
        self.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices]

    @contextlib.contextmanager
    def restored(self):
        with torch.random.fork_rng(devices=self.devices if self.preserve else [], enabled=self.preserve):
            if self.preserve:
                torch.set_rng_state(self.cpu_rng)
                set_device_states(self.devices, self.device_rngs)
            with contextlib.ExitStack() as stack:
                for device, enabled, dtype in self.autocast:
                    stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
                yield


class _Record:
    """Everything backward needs to run `fn` again: the function, its
    inputs' structure and non-tensor values, the stash of its tensors, the
    replay state; and the structure of its outputs."""

    def __init__(self, fn, flat_inputs, input_spec, stash, replay):
        self.fn, self.input_spec, self.stash, self.replay = fn, input_spec, stash, replay
        self.flat_inputs = flat_inputs  # the tensors among them are replaced by the stash's on each call
        self.output_leaves = self.output_spec = None  # set by the forward
        weakref.finalize(self, stash.release)  # a graph dropped without backward frees its checkpoint

    def call(self, tensors):
        args, kwargs = pytree.tree_unflatten(_fill(self.flat_inputs, tensors), self.input_spec)
        return self.fn(*args, **kwargs)


def _fill(leaves, tensors) -> list:
    """leaves with their tensors replaced, in order, by `tensors`."""
    it = iter(tensors)
    return [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]


def _opaque_holding_tensors(leaf) -> bool:
    """A leaf pytree does not look into (not a tensor nor a plain value)
    that holds tensors: their gradients could not flow out."""
    if isinstance(leaf, (torch.Tensor, *_PLAIN)):
        return False
    return any(isinstance(v, torch.Tensor) for v in getattr(leaf, "__dict__", {}).values())


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, record, anchor, *tensors):
        out = record.call(tensors)
        leaves, record.output_spec = pytree.tree_flatten(out)
        for leaf in leaves:
            if _opaque_holding_tensors(leaf):
                raise TypeError(_error(
                    f"fn returned a {type(leaf).__name__} holding tensors; gradients cannot flow out of a "
                    "checkpoint through it (they flow through tensors and tuples, lists and dicts of them). "
                    f"Return the tensors, or register {type(leaf).__name__} with "
                    "torch.utils._pytree.register_pytree_node"))
        record.output_leaves = leaves
        ids = {id(t) for t in tensors}
        outputs = tuple(x.detach() if id(x) in ids else x for x in leaves if isinstance(x, torch.Tensor))
        ctx.mark_non_differentiable(*[o for o in outputs if not (o.is_floating_point() or o.is_complex())])
        ctx.record = record
        # What autograd keeps of this checkpoint: this rank's segment (what
        # saved-tensor hooks see, and what tests measure).
        ctx.save_for_backward(record.stash.segment)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        record = ctx.record
        ctx.saved_tensors  # noqa: B018 - unpacks: raises if backward already ran and freed them
        stash = record.stash
        stash.fetch()
        ahead = stash.previous()
        if ahead is not None:
            ahead.fetch()  # in flight while this checkpoint recomputes
        try:
            inputs = stash.inputs()
            with record.replay.restored(), torch.enable_grad():
                out = record.call(inputs)
            outputs = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
            pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        finally:  # after the recomputation: inputs may be views of the stash's buffer
            stash.release()
        return (None, None, *[t.grad if t.requires_grad else None for t in inputs])


def checkpoint(fn, *args, group=None, offload=None, contiguous=True, preserve_rng_state=True, use_reentrant=None,
               **kwargs):
    """fn(*args, **kwargs), keeping its inputs, not its activations, for
    backward: partitioned across `group`, the model-parallel process group
    whose ranks all compute the same inputs (None: whole, on this rank),
    on the host with offload="cpu", in buffers allocated once with
    contiguous=True (the module's docstring says how). A drop-in for
    torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
    **kwargs); call it at the same point on every rank of `group`."""
    if use_reentrant:
        raise ValueError(_error("use_reentrant=True is not supported; zerocore.checkpoint has the non-reentrant "
                                "variant's semantics (leave use_reentrant out, or pass False)"))
    if offload not in OFFLOADS:
        raise ValueError(_error(f"offload must be None or \"cpu\", got {offload!r}"))
    if not callable(fn):
        raise TypeError(_error(f"fn must be callable, got {type(fn).__name__}"))
    if not torch.is_grad_enabled():  # no backward will come: nothing to keep (as torch's checkpoint)
        return fn(*args, **kwargs)
    partition = _partition_of(group)
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    if not tensors:
        raise ValueError(_error("fn got no tensor arguments; a checkpoint keeps fn's tensor inputs to run it "
                                "again in backward, so pass the activations fn computes from as arguments"))
    if len({t.device for t in tensors}) > 1:
        raise ValueError(_error(f"fn's tensor arguments are on several devices ({sorted({str(t.device) for t in tensors})}); "
                                "a checkpoint keeps them in one buffer of one device: move them to one"))
    stash = _Stash(tensors, partition, offload, contiguous)
    record = _Record(fn, flat, spec, stash, _Replay(tensors, preserve_rng_state))
    # The anchor requires grad, so that backward reaches the checkpoint even
    # when no input does (params used inside fn still need their grads).
    anchor = torch.empty(0, requires_grad=True)
    try:
        outputs = _CheckpointFunction.apply(record, anchor, *tensors)
    except BaseException:
        stash.release()  # fn failed: nothing is kept, whatever still refers to the record
        raise
    leaves, record.output_leaves = _fill(record.output_leaves, outputs), None  # the graph's outputs, not fn's
    return pytree.tree_unflatten(leaves, record.output_spec)
