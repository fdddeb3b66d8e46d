"""Where zerocore trains: the one place that decides which devices and
which process groups wrap accepts, and which runtime backend an engine runs
on (decide).

- A module whose params and buffers are all on the CPU (or on the meta
  device, which wrap materialises where wrap's device= says: the CPU by
  default) runs on the process's default
  backend, zerocore._native.process_backend(): the plain CPU backend, or the
  checking one under ZEROCORE_BACKEND=checking. Its collectives run over a
  process group that moves CPU tensors (gloo, or a group with a CPU backend
  beside another, such as "cpu:gloo,cuda:nccl").
- A module all on one CUDA device k runs on a CudaBackend of device k whose
  compute stream is torch's current stream there (followed from step to
  step: zerocore/runtime/compute_stream.py), where zerocore was built
  with CUDA and torch can use a GPU (cuda_usable()); its data collectives run
  over a group that moves CUDA tensors (NCCL: "cpu:gloo,cuda:nccl"), its
  control plane on gloo groups the engine makes beside it; under
  ZEROCORE_CUDA_POISON=1 the backend poisons released memory
  (_poison_released). A model built on the meta device trains there when
  wrap is given device="cuda" (so a model larger than the GPU, with
  offload_params, never exists whole on it).
- A backend given to wrap (backend=: a CheckingBackend for a test) replaces
  the one chosen, where it can run the module's device.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from zerocore import _native

_CUDA_BUILT = hasattr(_native, "CudaBackend")  # the runtime's CUDA backend is in this build
SUPPORTED = ("cpu", "cuda") if _CUDA_BUILT else ("cpu",)  # device types the runtime can train on
_CPU = torch.device("cpu")
_MATERIALIZED = ("meta",)  # params and buffers that get their values at wrap (on its device=, the CPU by default)


def cuda_usable() -> bool:
    """A CUDA module can train here: zerocore was built with its CUDA
    backend and torch can use a GPU."""
    return _CUDA_BUILT and torch.cuda.is_available()


def cuda_missing() -> str:
    """Why a CUDA module cannot train here (when cuda_usable() is False)."""
    if not _CUDA_BUILT:
        return ("zerocore was built without its CUDA backend (rebuild it with ZEROCORE_CUDA=ON and nvcc on the "
                "PATH)")
    return "torch.cuda.is_available() is False here (a CPU build of torch, or no NVIDIA driver or device)"


def is_cuda(backend) -> bool:
    """`backend` is a CudaBackend: the torch.distributed transport issues
    CUDA tensors' collectives on its comm streams."""
    return _CUDA_BUILT and isinstance(backend, _native.CudaBackend)


@dataclass(frozen=True)
class Decision:
    """Where an engine trains. device: the module's device (the CPU where
    there is a problem); backend: the zerocore._native.Backend its native
    objects run on; problem: why wrap refuses the module's devices or the
    backend given, or None. With a problem the device is the CPU and the
    backend the process's default, so that the ranks can agree to raise."""
    device: torch.device
    backend: object
    problem: Optional[str] = None


def decide(tensors: Iterable, backend=None, meta_device=None) -> Decision:
    """The device and backend of a module whose params and buffers are the
    (name, device) pairs `tensors`; backend: the one wrap was given, or
    None to choose it here; meta_device: where meta tensors are
    materialised and train (wrap's device=; None: the CPU)."""
    tensors = list(tensors)
    problem = meta_device_problem(meta_device)
    if problem is None:
        meta_device = torch.device("cpu") if meta_device is None else _indexed(torch.device(meta_device))
        problem = tensor_problem(tensors, meta_device)
    device = training_device((d for _, d in tensors), meta_device) if problem is None else None
    problem = problem or backend_problem(device, backend)
    if problem is not None:
        return Decision(torch.device("cpu"), _native.process_backend(), problem)
    return Decision(device, backend if backend is not None else _backend_for(device))


def meta_device_problem(device) -> Optional[str]:
    """The error for wrap's device= (where meta tensors train), or None."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as e:
        return f"zerocore.wrap: device= takes a torch.device or a string such as 'cuda' or 'cpu', got {device!r} ({e})"
    if device.type not in SUPPORTED:
        return (f"zerocore.wrap: device={str(device)!r}: zerocore trains on "
                f"{' and '.join(SUPPORTED)} devices" + (f" ({cuda_missing()})" if not _CUDA_BUILT else ""))
    if device.type == "cuda" and not cuda_usable():
        return f"zerocore.wrap: device={str(device)!r}, but {cuda_missing()}"
    return None


def _indexed(device: torch.device) -> torch.device:
    """'cuda' as the current CUDA device, as torch places a tensor made there."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def training_device(devices: Iterable[torch.device], meta_device: torch.device = _CPU) -> torch.device:
    """The one device of a module's params and buffers that tensor_problem
    accepts: meta_device for a module all on the meta device, or with
    neither params nor buffers."""
    placed = {d for d in devices if d.type not in _MATERIALIZED}
    return placed.pop() if placed else meta_device


def tensor_problem(tensors: Iterable, meta_device: torch.device = _CPU) -> Optional[str]:
    """The error for (name, device) pairs of a module's params and buffers
    that wrap cannot train, or None: they must all be on the CPU (or the
    meta device), or all on one CUDA device where cuda_usable(); meta ones
    count as on meta_device, where they are materialised."""
    tensors = list(tensors)
    usable = ("cpu", "cuda") if cuda_usable() else ("cpu",)
    bad = [(name, device) for name, device in tensors if device.type not in usable + _MATERIALIZED]
    if bad:
        on_cuda = any(device.type == "cuda" for _, device in bad)
        why = (f"zerocore trains on the CPU{' and on CUDA devices' if _CUDA_BUILT else ''}"
               + (f", and {cuda_missing()}" if on_cuda else ""))
        return (f"zerocore.wrap: {_listing(bad)} {'is' if len(bad) == 1 else 'are'} not on the CPU. {why}: move "
                "the model to the CPU (model.cpu()) before wrapping it, or build it on the meta device "
                "(zerocore.init()) for wrap to materialise.")
    # Meta tensors get their values on meta_device, so beside others they may be a second device.
    by_device = {}
    for name, device in tensors:
        by_device.setdefault(meta_device if device.type in _MATERIALIZED else device, []).append((name, device))
    if len(by_device) > 1:
        where = "; ".join(f"{_listing(pairs)} on {device}" for device, pairs in by_device.items())
        return (f"zerocore.wrap: the module's params and buffers are on more than one device ({where}); a meta "
                f"one is materialised on {meta_device} (wrap's device=). Move the whole model to the device it "
                "trains on (model.to(device)) before wrapping it, or build it all on the meta device and give wrap "
                "device=.")
    return None


def _listing(pairs) -> str:
    """'a (cuda:0), b (cuda:0) and 3 more'."""
    pairs = list(pairs)
    return ", ".join(f"{name} ({device})" for name, device in pairs[:3]) + (
        f" and {len(pairs) - 3} more" if len(pairs) > 3 else "")


def backend_problem(device: torch.device, backend) -> Optional[str]:
    """The error for a backend given to wrap (backend=) that cannot run a
    module on `device`, or None (also when none was given)."""
    if backend is None:
        return None
    kinds = "CpuBackend, CheckingBackend" + (" or CudaBackend" if _CUDA_BUILT else "")
    if not isinstance(backend, _native.Backend):
        return f"zerocore.wrap: backend= takes a zerocore._native.Backend ({kinds}), got {type(backend).__name__}"
    on_cuda = is_cuda(backend)
    if device.type == "cuda" and not (on_cuda and backend.device == device.index):
        return (f"zerocore.wrap: the module is on {device}, so backend= must be a CudaBackend of device "
                f"{device.index}, got {_describe(backend)}")
    if device.type == "cpu" and on_cuda:
        return (f"zerocore.wrap: the module is on the CPU, so backend= must be a CPU backend (CpuBackend or "
                f"CheckingBackend), got {_describe(backend)}")
    return None


def _describe(backend) -> str:
    if is_cuda(backend):
        return f"a CudaBackend of cuda:{backend.device}"
    return f"a {type(backend).__name__}"


def _backend_for(device: torch.device):
    """The backend a module on `device` runs on when given none."""
    if device.type == "cpu":
        return _native.process_backend()
    return _native.CudaBackend(device.index, current_stream(device), poison_released=_poison_released())


def current_stream(device: torch.device) -> int:
    """The cudaStream_t of torch's current stream on `device`: the compute
    stream of the engine's CUDA backend (zerocore/runtime/compute_stream.py keeps
    it so from step to step)."""
    return torch.cuda.current_stream(device).cuda_stream


def _poison_released() -> bool:
    """ZEROCORE_CUDA_POISON=1: the CUDA backend fills every slot and staging
    range the runtime releases with NaN, so a read after the release shows
    in the results (a debug option; tests/gpu.sh runs the GPU tests so). Off
    (unset or 0) it writes nothing: it is a memset per release."""
    value = os.environ.get("ZEROCORE_CUDA_POISON", "0")
    if value not in ("0", "1"):
        raise ValueError(f"ZEROCORE_CUDA_POISON={value!r}: set it to 1 to poison released CUDA memory with NaN, "
                         "or to 0 (or leave it unset) for none")
    return value == "1"


def group_problem(device_types: Iterable[str], backend: str, device_type: str = "cpu") -> Optional[str]:
    """The error for a process group whose backends cannot move tensors of
    `device_type` (the module's), or None. device_types: what the group
    moves (see device_types); backend: its backend config, for the message."""
    if device_type in tuple(device_types):
        return None
    if device_type == "cpu":
        return (f"zerocore.wrap: the process group's backend ({backend}) cannot move cpu tensors, which the "
                "module's params and buffers are. Create the group with a CPU backend: "
                "torch.distributed.init_process_group(\"gloo\"), or \"cpu:gloo,cuda:nccl\" to keep NCCL for your "
                "own CUDA collectives.")
    return (f"zerocore.wrap: the process group's backend ({backend}) cannot move {device_type} tensors, which the "
            "module's params and buffers are. Create the group with NCCL for them: "
            "torch.distributed.init_process_group(\"cpu:gloo,cuda:nccl\") (the engine runs its control plane on "
            "gloo groups of its own).")


def missing_group_problem(device: torch.device) -> Optional[str]:
    """The error for a module on `device` wrapped without a process group
    (stage 0 on one process), or None: a CUDA module's collectives run over
    NCCL, which only a process group has."""
    if device.type == "cpu":
        return None
    return (f"zerocore.wrap: the module is on {device}, whose collectives run over a torch.distributed process "
            "group (NCCL); call torch.distributed.init_process_group(\"cpu:gloo,cuda:nccl\") first (or torchrun; "
            "a group of one rank is fine), or pass group=.")


def device_types(backend_config: str) -> tuple:
    """The device types a process group moves tensors of, from its backend
    config (torch.distributed.get_backend_config: "gloo", "nccl",
    "cpu:gloo,cuda:nccl")."""
    import torch.distributed as dist

    if ":" in backend_config:
        return tuple(part.split(":")[0] for part in backend_config.split(","))
    return tuple(dist.Backend.backend_capability.get(backend_config.lower(), ()))
