"""The data planes tests/test_gpu_ranks.py trains its ranks over, all on
one GPU: gloo (CUDA tensors staged through pinned host memory), torch's
NCCL group and zerocore's native NCCL transport (Config(nccl="native")).

NCCL refuses two ranks on one device ("Duplicate GPU detected") before
2.30; from 2.30 on it allows them, experimentally, with
NCCL_MULTI_RANK_GPU_ENABLE=1 (and NVLS off: NCCL_NVLS_ENABLE=0; its
co-located ranks then talk through host shared memory, not P2P). So an NCCL
plane runs only where the NCCL that would carry it is 2.30 or later, and is
skipped otherwise with that NCCL's version named. Which NCCL that is:
torch's group uses the libnccl torch loaded (torch.cuda.nccl.version()), the
native transport the one zerocore.comm.nccl.library_path() names
(ZEROCORE_NCCL_LIBRARY first): tests/README.md says how to point either at
a newer one."""
from dataclasses import dataclass, field
from typing import Optional

MULTI_RANK_GPU = (2, 30, 0)  # the first NCCL that lets several ranks share a device
MULTI_RANK_GPU_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}


@dataclass(frozen=True)
class DataPlane:
    name: str
    group: str  # the default process group's backend (init_process_group's)
    config: dict = field(default_factory=dict)  # what the engine's Config adds
    env: dict = field(default_factory=dict)  # what the ranks' environment adds


PLANES = (
    DataPlane("gloo", "gloo"),
    DataPlane("nccl", "cpu:gloo,cuda:nccl", {"nccl": "torch"}, MULTI_RANK_GPU_ENV),
    DataPlane("nccl-native", "cpu:gloo,cuda:nccl", {"nccl": "native"}, MULTI_RANK_GPU_ENV),
)


def version_of(code: int) -> tuple:
    """ncclGetVersion's code as (major, minor, patch): major * 10000 +
    minor * 100 + patch from NCCL 2.9 on, major * 1000 + minor * 100 +
    patch before."""
    if code >= 20900:
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


def multi_rank_refusal(version: tuple, which: str) -> Optional[str]:
    """Why `which` NCCL, of `version`, cannot run several ranks on one GPU;
    None where it can."""
    if tuple(version) >= MULTI_RANK_GPU:
        return None
    return (f"{which} is NCCL {'.'.join(map(str, version))}; several ranks on one GPU need NCCL >= "
            f"{'.'.join(map(str, MULTI_RANK_GPU))} (NCCL_MULTI_RANK_GPU_ENABLE=1)")


def skip_reason(plane: DataPlane) -> Optional[str]:
    """Why this machine cannot run `plane` with several ranks on one GPU;
    None where it can."""
    import torch
    import torch.distributed as dist

    if plane.name == "gloo":
        return None
    if not dist.is_nccl_available():
        return "torch was built without NCCL"
    if plane.config.get("nccl") == "native":
        import zerocore.comm.nccl

        if not zerocore.comm.nccl.is_built():
            return zerocore.comm.nccl.unavailable_reason()
        try:
            library = zerocore.comm.nccl.load()
        except RuntimeError as e:
            return str(e)
        return multi_rank_refusal(version_of(library.version),
                                  f"the native transport's library ({library.path or 'libnccl.so.2'})")
    return multi_rank_refusal(torch.cuda.nccl.version(), "torch's NCCL")
