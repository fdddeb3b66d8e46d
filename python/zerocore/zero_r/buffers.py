"""Where zerocore.checkpoint's slices live (checkpoint.py's docstring says
how): per backend a Home with its contiguous arenas (one flat buffer per
memory kind, reused every step) and the device buffers offload works in;
the checkpoints alive and the bytes they hold (activation_memory)."""
from __future__ import annotations

import os

import torch

from zerocore.runtime import devices

ALIGN = 16  # bytes: every slice starts at a multiple, so a byte view of it views any dtype in place
live: list = []  # the stashes (stash.py) not yet released, in the order their checkpoints were made


def error(message: str) -> str:
    return f"zerocore.checkpoint: {message}"


# Backends ----------------------------------------------------------------------
# devices.decide's choice for each device checkpoints were made on without
# backend=, kept: decide makes a new CudaBackend at each call, and a device's
# copy stream and contiguous buffers must stay one backend's from one
# checkpoint to the next (for the CPU it is the process's backend anyway).
chosen: dict = {}


def backend_for(device: torch.device, backend):
    """The backend a checkpoint of tensors on `device` lives on: `backend`
    (checkpoint's backend=) where it can run that device, else the one an
    engine on the device runs on."""
    if backend is None and device in chosen:
        return chosen[device]
    decision = devices.decide([("fn's tensor arguments", device)], backend)
    if decision.problem is not None:
        if backend is not None:
            why = (f"backend= must be a backend of that device (a CpuBackend or CheckingBackend for the CPU, a "
                   f"CudaBackend of device k for cuda:k), got {type(backend).__name__}; or leave it out")
        elif device.type == "cuda":
            why = devices.cuda_missing()
        else:
            why = "zerocore keeps checkpoints on the CPU and on CUDA devices; move them to one"
        raise ValueError(error(f"fn's tensor arguments are on {device}: {why}"))
    if backend is None:
        chosen[device] = decision.backend
    return decision.backend


def allocate(backend, kind: str, nbytes: int, name: str) -> torch.Tensor:
    """A new buffer of `backend` of `nbytes` (a multiple of ALIGN), as a
    torch uint8 tensor; the buffer lives as long as a view of it does."""
    buffer = backend.allocate(kind, max(nbytes, ALIGN), name)
    return torch.from_dlpack(buffer.view(0, "float32", [nbytes // 4])).view(torch.uint8)


def floats(t: torch.Tensor) -> torch.Tensor:
    """A byte range (a multiple of ALIGN long, aligned) as float32: the
    backend's copies and declarations take float tensors."""
    return t.view(torch.float32)


class Home:
    """What the checkpoints on one backend share: its contiguous buffers (one
    per memory kind), the device buffers offload works in and the stream
    the offload copies run on."""

    def __init__(self, backend):
        self.backend = backend
        self.free()
        self._copy = None  # (pid, stream) once an offload made it

    def free(self):
        """Drops the buffers (their memory goes once no view is left)."""
        self.arenas = {kind: Arena(self.backend, kind) for kind in ("device", "host_pinned")}
        self.offload_buffers = OffloadBuffers(self.backend)

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


homes: dict = {}  # backend -> its Home


def home_of(backend) -> Home:
    if backend not in homes:
        homes[backend] = Home(backend)
    return homes[backend]


# Buffers ---------------------------------------------------------------------
class Arena:
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
        return allocate(self.backend, self.kind, nbytes, name)

    def give_back(self):
        self.live -= 1
        if self.live:
            return
        if self.buffer is None or self.top > self.buffer.numel():  # sized on the first step, grown if outgrown
            self.buffer = None
            self.buffer = allocate(self.backend, self.kind, self.top, "contiguous activation checkpoints")
        self.top = 0


class OffloadBuffers:
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
        return allocate(self.backend, "device", nbytes, "offloaded activation checkpoints on the device")

    def give_back(self, buffer: torch.Tensor, last_use):
        self.spare.append((buffer, last_use))


def buffer_bytes(offloaded=None) -> int:
    """Bytes of the checkpoint buffers this process holds: the contiguous
    buffers (from the end of the first step) and the device buffers offload
    works in; offloaded: True, only those on the host (offload="cpu"),
    False, only those on the tensors' device."""
    held = 0
    for home in homes.values():
        held += sum(a.buffer.numel() for kind, a in home.arenas.items()
                    if a.buffer is not None and offloaded in (None, kind == "host_pinned"))
        held += home.offload_buffers.bytes if offloaded in (None, False) else 0
    return held


def free_buffers():
    """Gives the buffers buffer_bytes() counts back to their backends,
    between steps (no checkpoint alive); the next step makes them again. A
    backend given to checkpoint (backend=) is forgotten with them."""
    if live:
        raise RuntimeError(error(f"free_buffers() with {len(live)} checkpoint(s) alive (made in a forward, not yet "
                                  "backpropagated through or dropped); call it between steps"))
    for backend in list(homes):
        homes[backend].free()
        if not any(backend is chosen for chosen in chosen.values()):
            del homes[backend]


class Usage:
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
        if not live:
            self.last = {"kept": self.peak_kept, "unpartitioned": self.peak_whole}
            self.peak_kept = self.peak_whole = 0


usage = Usage()


def activation_memory() -> dict:
    """This rank's activation-checkpoint memory, in bytes: "buffers", the
    contiguous buffers held (buffer_bytes()); "kept", the most the
    checkpoints of the last finished step held at once on this rank; and
    "unpartitioned", what those checkpoints would have held whole."""
    return {"buffers": buffer_bytes(), **usage.last}
