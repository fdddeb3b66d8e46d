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

The slices' memory and copies go through the runtime's backend seam
(docs/runtime.md, "The backend seam"), as the engine's do: every buffer is
one a zerocore._native.Backend allocated, seen by torch through DLPack; the
offload copies run on a stream of that backend's own and are ordered
against its compute stream by its events; where torch on the compute stream
writes or reads a buffer (writing the slices, the gather and the
recomputation reading them) the access is declared to the backend. So under
the checking backend (ZEROCORE_BACKEND=checking, or a CheckingBackend given
as backend=) every access to a checkpoint's buffers is checked for a missing
wait. The backend is the one an engine on the tensors' device runs on
(zerocore.devices.decide): the process's backend for the CPU, a CudaBackend
of the device whose compute stream is torch's current stream for CUDA.

Where a checkpoint's slices live:
- contiguous=True: in one flat byte buffer per backend (one per device) and
  memory kind ("device", or "host_pinned" for offload), allocated once: the
  first step (the first forward-backward, from the first checkpoint made to
  the last one released) allocates each slice on its own and measures the
  total; at its end the buffer is allocated at that size and every later
  step carves its slices out of it. A step that needs more uses separate
  allocations for the excess and the buffer grows to fit once that step
  ends. Its size is `buffer_bytes()`, reported by
  `engine.memory_report()["activations"]`; `free_buffers()` gives it back
  between steps.
- contiguous=False: one allocation per checkpoint.
- offload="cpu": the slices are packed into a device buffer on the compute
  stream and copied to pinned host memory on the backend's copy stream
  ("activation offload"), and copied back to a device buffer on that
  stream two checkpoints ahead of backward's need; the compute stream waits
  for that copy (a stream wait: on CUDA the host goes on) before the
  gather. The device buffers are kept for reuse (as many as were in use at
  once: three in backward) and counted by `buffer_bytes()`. On the CPU the
  same copies run between host buffers.

The gathers run asynchronously (torch.distributed, async_op) on a process
group of the same ranks as `group` but of this module alone, so none waits
behind, or is mistaken for, the model's own collectives; they are issued in
the compute stream's order (NCCL waits for torch's current stream) and
gather into torch's memory. Every rank of the group must make the same
checkpoints in the same order, as model-parallel ranks do.

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
import itertools
import os
import weakref

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import get_device_states, set_device_states

from zerocore import devices
from zerocore.process_group import all_gather_single, private_group

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


# Backends ----------------------------------------------------------------------
# devices.decide's choice for each device checkpoints were made on without
# backend=, kept: decide makes a new CudaBackend at each call, and a device's
# copy stream and contiguous buffers must stay one backend's from one
# checkpoint to the next (for the CPU it is the process's backend anyway).
_chosen: dict = {}


def _backend_for(device: torch.device, backend):
    """The backend a checkpoint of tensors on `device` lives on: `backend`
    (checkpoint's backend=) where it can run that device, else the one an
    engine on the device runs on."""
    if backend is None and device in _chosen:
        return _chosen[device]
    decision = devices.decide([("fn's tensor arguments", device)], backend)
    if decision.problem is not None:
        if backend is not None:
            why = (f"backend= must be a backend of that device (a CpuBackend or CheckingBackend for the CPU, a "
                   f"CudaBackend of device k for cuda:k), got {type(backend).__name__}; or leave it out")
        elif device.type == "cuda":
            why = devices.cuda_missing()
        else:
            why = "zerocore keeps checkpoints on the CPU and on CUDA devices; move them to one"
        raise ValueError(_error(f"fn's tensor arguments are on {device}: {why}"))
    if backend is None:
        _chosen[device] = decision.backend
    return decision.backend


def _allocate(backend, kind: str, nbytes: int, name: str) -> torch.Tensor:
    """A new buffer of `backend` of `nbytes` (a multiple of _ALIGN), as a
    torch uint8 tensor; the buffer lives as long as a view of it does."""
    buffer = backend.allocate(kind, max(nbytes, _ALIGN), name)
    return torch.from_dlpack(buffer.view(0, "float32", [nbytes // 4])).view(torch.uint8)


def _floats(t: torch.Tensor) -> torch.Tensor:
    """A byte range (a multiple of _ALIGN long, aligned) as float32: the
    backend's copies and declarations take float tensors."""
    return t.view(torch.float32)


class _Home:
    """What the checkpoints on one backend share: its contiguous buffers (one
    per memory kind), the device buffers offload works in and the stream
    the offload copies run on."""

    def __init__(self, backend):
        self.backend = backend
        self.free()
        self._copy = None  # (pid, stream) once an offload made it

    def free(self):
        """Drops the buffers (their memory goes once no view is left)."""
        self.arenas = {kind: _Arena(self.backend, kind) for kind in ("device", "host_pinned")}
        self.offload_buffers = _OffloadBuffers(self.backend)

    def compute(self):
        """The backend's compute stream, where torch's work of a checkpoint
        runs: on CUDA torch's current stream, which may change between
        calls, so it is set at each use."""
        if devices.is_cuda(self.backend):
            self.backend.set_compute_stream(torch.cuda.current_stream(self.backend.device).cuda_stream)
        return self.backend.compute_stream()

    def copy_stream(self):
        """The offload copies' stream, made by this process on its first
        offload: a forked rank inherits its parent's stream but not the
        thread that runs a CPU backend's stream, so it makes its own."""
        if self._copy is None or self._copy[0] != os.getpid():
            self._copy = (os.getpid(), self.backend.create_stream("activation offload"))
        return self._copy[1]


_homes: dict = {}  # backend -> its _Home


def _home_of(backend) -> _Home:
    if backend not in _homes:
        _homes[backend] = _Home(backend)
    return _homes[backend]


# Buffers ---------------------------------------------------------------------
class _Arena:
    """One flat byte buffer of a backend's memory kind for the slices of one
    step, reused every step. Slices are carved one after another; the space
    comes back all at once, when the step's last checkpoint is released."""

    def __init__(self, backend, kind: str):
        self.backend, self.kind = backend, kind
        self.buffer = None
        self.top = 0  # bytes carved this step
        self.live = 0  # slices carved this step not yet released

    def take(self, nbytes: int, name: str) -> torch.Tensor:
        start, self.top = self.top, self.top + nbytes
        self.live += 1
        if self.buffer is not None and self.top <= self.buffer.numel():
            # .data: a view with a version counter of its own, so that writing
            # the next slice does not invalidate this one where autograd saved it.
            return self.buffer.data[start:self.top]
        return _allocate(self.backend, self.kind, nbytes, name)

    def give_back(self):
        self.live -= 1
        if self.live:
            return
        if self.buffer is None or self.top > self.buffer.numel():  # sized on the first step, grown if outgrown
            self.buffer = None
            self.buffer = _allocate(self.backend, self.kind, self.top, "contiguous activation checkpoints")
        self.top = 0


class _OffloadBuffers:
    """The device buffers offload works in, each kept for the next use once
    given back (on CUDA freeing one is a cudaFree, which synchronises the
    device): the compute stream packs a checkpoint's slices into one for
    the copy down, and backward copies a checkpoint back into one. A buffer
    comes back with the event after its last use, which the stream that
    takes it next waits for. There are never more of them than were in use
    at once: one in a forward, three in a backward through a chain of
    checkpoints (the one recomputed, the one being gathered, the one being
    copied back)."""

    def __init__(self, backend):
        self.backend = backend
        self.spare = []  # (buffer: a torch uint8 view of a whole backend buffer, the event after its last use)
        self.bytes = 0  # of the buffers kept, spare or in use

    def take(self, nbytes: int, stream) -> torch.Tensor:
        """A buffer of at least nbytes for `stream` to use: the smallest
        spare that fits, once `stream` waited for its last use; else a new
        one in place of the smallest spare (which fits none so far)."""
        fits = [spare for spare in self.spare if spare[0].numel() >= nbytes]
        chosen = min(fits or self.spare, key=lambda spare: spare[0].numel(), default=None)
        self.spare = [spare for spare in self.spare if spare is not chosen]  # by identity: tensors compare by value
        if fits:
            self.backend.wait(stream, chosen[1])
            return chosen[0]
        self.bytes += nbytes - (chosen[0].numel() if chosen else 0)
        return _allocate(self.backend, "device", nbytes, "offloaded activation checkpoints on the device")

    def give_back(self, buffer: torch.Tensor, last_use):
        self.spare.append((buffer, last_use))


def buffer_bytes(offloaded=None) -> int:
    """Bytes of the checkpoint buffers this process holds: the contiguous
    buffers (from the end of the first step) and the device buffers offload
    works in; offloaded: True, only those on the host (offload="cpu"),
    False, only those on the tensors' device."""
    held = 0
    for home in _homes.values():
        held += sum(a.buffer.numel() for kind, a in home.arenas.items()
                    if a.buffer is not None and offloaded in (None, kind == "host_pinned"))
        held += home.offload_buffers.bytes if offloaded in (None, False) else 0
    return held


def free_buffers():
    """Gives the buffers buffer_bytes() counts back to their backends,
    between steps (no checkpoint alive); the next step makes them again. A
    backend given to checkpoint (backend=) is forgotten with them."""
    if _live:
        raise RuntimeError(_error(f"free_buffers() with {len(_live)} checkpoint(s) alive (made in a forward, not yet "
                                  "backpropagated through or dropped); call it between steps"))
    for backend in list(_homes):
        _homes[backend].free()
        if not any(backend is chosen for chosen in _chosen.values()):
            del _homes[backend]


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


# One checkpoint's partitioned inputs -------------------------------------------
_live: list = []  # the stashes not yet released, in the order their checkpoints were made
_numbers = itertools.count()  # names checkpoints in the backend's buffers and declared accesses


class _Stash:
    """The checkpoint's tensors as this rank keeps them: its slice of each,
    one after another in one byte segment (each slice padded to _ALIGN
    bytes) of its backend's memory, on the tensors' device or, offloaded,
    in pinned host memory. bring_back() starts copying an offloaded segment
    back to the device, fetch() starts bringing every rank's segment back
    (the copy, then the all-gather), inputs() waits for it and rebuilds the
    tensors."""

    def __init__(self, tensors, partition: _Partition, offload, contiguous: bool, home: _Home):
        self.partition, self.home = partition, home
        self.name = f"checkpoint {next(_numbers)}"
        self.meta = [(t.shape, t.dtype, t.requires_grad) for t in tensors]
        self.device = tensors[0].device
        world = partition.world
        # Per tensor: bytes a rank keeps, a multiple of _ALIGN and of the element size.
        self.slice_bytes = [-(-(-(-t.numel() // world) * t.element_size()) // _ALIGN) * _ALIGN for t in tensors]
        self.nbytes = sum(self.slice_bytes)
        self.whole_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.offloaded = offload == "cpu"
        kind = "host_pinned" if self.offloaded else "device"
        self.arena = home.arenas[kind] if contiguous else None
        what = f"slices of {self.name}"
        self.segment = self.arena.take(self.nbytes, what) if contiguous else \
            _allocate(home.backend, kind, self.nbytes, what)
        self._write_slices(tensors)
        self.landing = self.landed = None  # offloaded: the device buffer it comes back to, and the copy's event
        self.pending = None  # (all-gather work or None, the gathered bytes) once fetch() ran
        self.released = False
        _live.append(self)
        _usage.add(self.nbytes, self.whole_bytes)

    def _write_slices(self, tensors):
        """The slices into the segment: written there by torch on the
        compute stream, or, offloaded, packed into a device buffer there and
        copied down on the copy stream once the compute stream packed them."""
        backend, compute = self.home.backend, self.home.compute()
        packing = self.home.offload_buffers.take(self.nbytes, compute) if self.offloaded else None
        target = self.segment if packing is None else packing[:self.nbytes]
        backend.declare_access(compute, _floats(target), "write", f"{self.name} writes its slices")
        offset = 0
        for t, nbytes in zip(tensors, self.slice_bytes):
            mine = self._my_slice(t.detach().reshape(-1), nbytes // t.element_size())
            target[offset:offset + mine.numel() * t.element_size()].view(t.dtype).copy_(mine)
            offset += nbytes
        if packing is not None:
            stream = self.home.copy_stream()
            backend.wait(stream, backend.record(compute))
            backend.copy(stream, _floats(self.segment), _floats(target))
            self.home.offload_buffers.give_back(packing, backend.record(stream))

    def _my_slice(self, flat: torch.Tensor, per_rank: int) -> torch.Tensor:
        start = min(self.partition.rank * per_rank, flat.numel())
        return flat[start:min(start + per_rank, flat.numel())]

    def _refuse_released(self):
        if self.released:
            raise RuntimeError(_error("this checkpoint was already backpropagated through and released; "
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
        backend.copy(stream, _floats(self.landing[:self.nbytes]), _floats(self.segment))
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
        backend.declare_access(compute, _floats(local), "read", f"all-gather of {self.name}")
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
            self.home.backend.declare_access(self.home.compute(), _floats(gathered), "read",
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
        _live.remove(self)
        if self.arena is not None:
            self.arena.give_back()
            self.arena = None  # a graph kept after backward keeps the stash, not the buffer
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
            further = ahead.previous()
            if further is not None:  # offloaded: copied back meanwhile, so the next gather need not wait for it
                further.bring_back()
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
               backend=None, **kwargs):
    """fn(*args, **kwargs), keeping its inputs, not its activations, for
    backward: partitioned across `group`, the model-parallel process group
    whose ranks all compute the same inputs (None: whole, on this rank),
    on the host with offload="cpu", in buffers allocated once with
    contiguous=True (the module's docstring says how). A drop-in for
    torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
    **kwargs); call it at the same point on every rank of `group`.
    backend (keyword only): the zerocore._native.Backend of the inputs'
    device that keeps the slices and copies them (a CheckingBackend, for a
    test to read its verdict; on CUDA its compute stream is set to torch's
    current stream); None, the one an engine on that device runs on."""
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
    home = _home_of(_backend_for(tensors[0].device, backend))
    stash = _Stash(tensors, partition, offload, contiguous, home)
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
