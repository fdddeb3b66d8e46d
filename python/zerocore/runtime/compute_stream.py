"""The stream an engine's CUDA backend orders its work against: torch's
current stream, followed from one step to the next.

The runtime orders its work (gathers, reductions, the step's kernels)
against its backend's compute stream, which must be the stream torch runs
the model on: a user who trains under `with torch.cuda.stream(s):` would
otherwise have the runtime wait for, and be waited for by, a stream the
model's work is not on. So each forward adopts torch's current stream,
backward and step check that it is still the one adopted, and a change is
taken between steps only: inside one (from the first forward that records
autograd, or the first backward, to the step or zero_grad that ends it)
autograd runs the backward on the forward's streams, so a change there
would leave work unordered and is refused. Adopting a new stream makes it
wait, on the device, for what the old one was given (set_compute_stream),
so the runtime's work keeps its order across the change.

On a CPU backend (no stream to follow) every call does nothing, so
torch.compile(engine, fullgraph=True) traces the forward whole there; on
CUDA following the stream is host work, a graph break before the module
(compile the module instead, as for buffers).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from zerocore.runtime import devices

_FOLLOWING = "zerocore: engine.forward follows torch's current CUDA stream on the host, a graph break before the module"


class ComputeStream:
    """An engine's compute stream. backend: the engine's; current: torch's
    current stream on its device as a cudaStream_t (an int), or None for
    a backend with no stream to follow (the CPU's)."""

    def __init__(self, backend, current: Optional[Callable[[], int]]):
        self._backend = backend
        self._current = current
        self._handle = backend.stream_handle(backend.compute_stream()) if current else None
        self._in_step = False  # a step's autograd or reduction ran on _handle

    def follow(self):
        """At the start of each forward: adopts torch's current stream,
        unless a step is under way on another (then raises)."""
        if self._current is not None:  # traced by torch.compile on the CPU: nothing to follow there
            self._follow()

    @torch.compiler.disable(reason=_FOLLOWING)
    def _follow(self):
        handle = self._current()
        if handle != self._handle:
            if self._in_step:
                raise RuntimeError(self._changed("engine.forward", handle))
            self._backend.set_compute_stream(handle)
            self._handle = handle
        self._in_step = self._in_step or torch.is_grad_enabled()

    def check(self, call: str):
        """At backward and step (`call` names it): torch's current stream
        must still be the one the step's forward adopted."""
        if self._current is None:
            return
        handle = self._current()
        if handle != self._handle:
            raise RuntimeError(self._changed(call, handle))
        self._in_step = True

    def end_step(self):
        """The step applied, or its grads zeroed: the next forward may
        change streams."""
        self._in_step = False

    def _changed(self, call: str, handle: int) -> str:
        return (f"zerocore: {call} runs on CUDA stream {_name(handle)} (torch's current stream on cuda:"
                f"{self._backend.device}), but this step's forward and backward ran on {_name(self._handle)}; the "
                "engine orders a step's work against one stream. Run every forward, backward and step of a step "
                "under the same stream (one `with torch.cuda.stream(s):` around all of them), and change streams "
                "between steps, after engine.step() or engine.zero_grad().")


def _name(handle: int) -> str:
    return "0 (the default stream)" if handle == 0 else hex(handle)


def of(backend) -> ComputeStream:
    """The compute stream of an engine on `backend`: torch's current stream
    on its device for a CudaBackend, nothing to follow for a CPU one."""
    if not devices.is_cuda(backend):
        return ComputeStream(backend, None)
    device = torch.device("cuda", backend.device)
    return ComputeStream(backend, lambda: devices.current_stream(device))
