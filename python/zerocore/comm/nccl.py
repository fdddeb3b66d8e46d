"""The native NCCL transport: the data plane's collectives on CUDA issued by
the comm queue's own threads straight into libnccl, instead of through
torch.distributed under the GIL (Config(nccl="native"); docs/runtime.md,
"The stream contract of communication").

The library is loaded at run time (zerocore._native.NcclLibrary, dlopen):
ZEROCORE_NCCL_LIBRARY if set, else the nvidia-nccl pip package's
lib/libnccl.so.2 (torch's CUDA wheels install it), else libnccl.so.2
through the loader's search. The transport makes its own communicator,
bootstrapped through torch.distributed's store as vLLM's PyNccl does: rank 0
makes the unique id and sets it under a key of the engine's group, the
other ranks get it. Only the data group goes native; the control plane's
gloo groups stay on the torch transport.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch.distributed as dist

from zerocore import _native

_LIBRARY_ENV = "ZEROCORE_NCCL_LIBRARY"
_DEFAULT_TIMEOUT_SECONDS = 1800.0  # torch.distributed's, for a group that shows none


def is_built() -> bool:
    """True when zerocore was built with the native NCCL transport."""
    return hasattr(_native, "NcclLibrary")


def unavailable_reason() -> Optional[str]:
    """Why this build has no native NCCL transport (None: it has one; loading
    the library may still fail, naming the path it tried)."""
    if is_built():
        return None
    if not hasattr(_native, "CudaBackend"):
        return "zerocore was built without CUDA (no CUDA compiler at build time, or ZEROCORE_CUDA=OFF)"
    return ("zerocore was built without the native NCCL transport: the build found no nccl.h (pip install "
            "nvidia-nccl-cu13 into the Python that builds zerocore, or pass -DZEROCORE_NCCL_INCLUDE_DIR)")


def library_path() -> str:
    """Where the library is loaded from ("": the loader's search for libnccl.so.2)."""
    if os.environ.get(_LIBRARY_ENV):
        return os.environ[_LIBRARY_ENV]
    try:
        import nvidia.nccl as package  # a namespace package: no __file__
    except ImportError:
        return ""
    for folder in package.__path__:
        candidate = os.path.join(folder, "lib", "libnccl.so.2")
        if os.path.exists(candidate):
            return candidate
    return ""


def load():
    """The loaded library (zerocore._native.NcclLibrary). RuntimeError naming
    what is missing and the fallback (Config(nccl="torch"))."""
    if not is_built():
        raise RuntimeError(f"zerocore: Config(nccl=\"native\") is not available: {unavailable_reason()}. "
                           "Use Config(nccl=\"torch\") (torch.distributed's NCCL).")
    return _native.NcclLibrary(library_path())


def store_key(group) -> str:
    """The store key of the unique id of `group`'s communicator: the
    engine's private group has a name of its own, the same on its ranks."""
    return f"zerocore/nccl/{group.group_name}/unique_id"


def exchange_unique_id(store, key: str, rank: int, make_id: Callable[[], bytes]) -> bytes:
    """Rank 0 makes the unique id (make_id()) and sets it under `key`; every
    other rank gets it (store.get waits for it, up to the store's timeout).
    Every rank returns the same bytes."""
    if rank == 0:
        unique_id = make_id()
        store.set(key, unique_id)
        return unique_id
    return store.get(key)


def queue(group, backend, timeout):
    """A zerocore._native.CommQueue over the native NCCL transport: a new
    communicator of `group`'s ranks, its collectives on the queue's comm
    stream, a stream of `backend` (a CudaBackend). timeout: a collective's
    (a timedelta; None: torch.distributed's default)."""
    library = load()
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    store = dist.distributed_c10d._get_default_store()
    unique_id = exchange_unique_id(store, store_key(group), rank, library.unique_id)
    seconds = timeout.total_seconds() if timeout is not None else _DEFAULT_TIMEOUT_SECONDS
    return library.queue(unique_id, rank, world_size, backend, seconds)
