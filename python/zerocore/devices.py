"""Where zerocore trains: the one place that decides which devices and
which process groups wrap accepts.

Today the runtime has one backend, the CPU's: params and buffers live in
host memory and collectives run over a process group that can move CPU
tensors (gloo, or a group with a CPU backend beside another, such as
"cpu:gloo,cuda:nccl"). The CUDA backend widens SUPPORTED here and nowhere
else.
"""
from __future__ import annotations

from typing import Iterable, Optional

SUPPORTED = ("cpu",)  # device types the runtime trains on
_MATERIALIZED = ("meta",)  # params and buffers that get their values (on the CPU) at wrap


def tensor_problem(tensors: Iterable) -> Optional[str]:
    """The error for (name, device) pairs of a module's params and buffers
    on a device the runtime cannot train on, or None."""
    bad = [(name, device) for name, device in tensors if device.type not in SUPPORTED + _MATERIALIZED]
    if not bad:
        return None
    names = ", ".join(f"{name} ({device})" for name, device in bad[:3]) + (f" and {len(bad) - 3} more"
                                                                            if len(bad) > 3 else "")
    return (f"zerocore.wrap: {names} {'is' if len(bad) == 1 else 'are'} not on the CPU. zerocore trains on the "
            f"CPU today (its runtime's CUDA backend is not built yet; device types supported: "
            f"{', '.join(SUPPORTED)}): move the model to the CPU (model.cpu()) before wrapping it, or build it "
            "on the meta device (zerocore.init()) for wrap to materialise.")


def group_problem(device_types: Iterable[str], backend: str) -> Optional[str]:
    """The error for a process group whose backends move none of the
    supported device types' tensors, or None."""
    if any(t in SUPPORTED for t in device_types):
        return None
    return (f"zerocore.wrap: the process group's backend ({backend}) cannot move {'/'.join(SUPPORTED)} tensors, "
            "and zerocore trains on the CPU today (its runtime's CUDA backend is not built yet). Create the "
            "group with a CPU backend: torch.distributed.init_process_group(\"gloo\"), or "
            "\"cpu:gloo,cuda:nccl\" to keep NCCL for your own CUDA collectives.")


def device_types(backend_config: str) -> tuple:
    """The device types a process group moves tensors of, from its backend
    config (torch.distributed.get_backend_config: "gloo", "nccl",
    "cpu:gloo,cuda:nccl")."""
    import torch.distributed as dist

    if ":" in backend_config:
        return tuple(part.split(":")[0] for part in backend_config.split(","))
    return tuple(dist.Backend.backend_capability.get(backend_config.lower(), ()))
