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
(zerocore.runtime.devices.decide): the process's backend for the CPU, a CudaBackend
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
import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import get_device_states, set_device_states

from zerocore.zero_r.buffers import backend_for, error, home_of
from zerocore.zero_r.stash import Stash, partition_of

OFFLOADS = (None, "cpu")
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


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
                raise TypeError(error(
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
        raise ValueError(error("use_reentrant=True is not supported; zerocore.checkpoint has the non-reentrant "
                                "variant's semantics (leave use_reentrant out, or pass False)"))
    if offload not in OFFLOADS:
        raise ValueError(error(f"offload must be None or \"cpu\", got {offload!r}"))
    if not callable(fn):
        raise TypeError(error(f"fn must be callable, got {type(fn).__name__}"))
    if not torch.is_grad_enabled():  # no backward will come: nothing to keep (as torch's checkpoint)
        return fn(*args, **kwargs)
    partition = partition_of(group)
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    if not tensors:
        raise ValueError(error("fn got no tensor arguments; a checkpoint keeps fn's tensor inputs to run it "
                                "again in backward, so pass the activations fn computes from as arguments"))
    if len({t.device for t in tensors}) > 1:
        raise ValueError(error(f"fn's tensor arguments are on several devices ({sorted({str(t.device) for t in tensors})}); "
                                "a checkpoint keeps them in one buffer of one device: move them to one"))
    home = home_of(backend_for(tensors[0].device, backend))
    stash = Stash(tensors, partition, offload, contiguous, home)
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
