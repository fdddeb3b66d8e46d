"""zerocore: ZeRO data parallelism and offload for PyTorch on a native runtime.

The native runtime (``zerocore._native``) never links PyTorch; tensors cross
as DLPack, zero-copy: ``zerocore.from_torch(t)`` wraps a torch tensor's
memory and ``zerocore.to_torch(z)`` (or ``torch.from_dlpack(z)``) views a
native tensor from torch. The CUDA kernels live in a separate module,
``zerocore.cuda``, imported only on use, so this package imports on machines
without CUDA.
"""

import warnings

# torch warns at import when numpy is missing. zerocore never uses numpy, so
# it is no dependency, and a fresh environment should not greet its user with
# that warning: silenced here, for this first import of torch only.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

from zerocore._native import (
    CollectiveTimeoutError,
    LayoutPlan,
    PartitionStore,
    Tensor,
    cpu_features,
    empty,
    host_arena_allocations,
    host_arena_bytes,
    num_threads,
    set_cpu_isa,
    set_num_threads,
    zeros,
)
from zerocore._native import from_dlpack as from_torch
from zerocore import ops
from zerocore.config import Config, DynamicLossScale
from zerocore.integrations.deepspeed.config import DeepSpeedConfig, DeepSpeedConfigError
from zerocore.zero_r.buffers import activation_memory
from zerocore.zero_r.checkpoint import checkpoint
from zerocore.comm.errors import CollectiveOrderError, RankDisagreementError
from zerocore.io.checkpoint_format import CheckpointError
from zerocore.engine import Engine, wrap
from zerocore.io.export import export
from zerocore.ops.loss_scale import NonFiniteGradientError
from zerocore.state.materialize import init
from zerocore.ops.optim import SGD, Adam, AdamW
from zerocore.sizing.estimate import estimate, largest_model
from zerocore.io.snapshot_restore import SnapshotLostError

__version__ = "0.1.0"


def to_torch(tensor: Tensor):
    """A torch tensor sharing ``tensor``'s memory (zero-copy)."""
    return torch.from_dlpack(tensor)


__all__ = [
    "Adam",
    "AdamW",
    "CheckpointError",
    "CollectiveOrderError",
    "CollectiveTimeoutError",
    "Config",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DynamicLossScale",
    "Engine",
    "LayoutPlan",
    "PartitionStore",
    "NonFiniteGradientError",
    "RankDisagreementError",
    "SnapshotLostError",
    "SGD",
    "Tensor",
    "activation_memory",
    "checkpoint",
    "cpu_features",
    "empty",
    "estimate",
    "export",
    "from_torch",
    "host_arena_allocations",
    "host_arena_bytes",
    "init",
    "largest_model",
    "num_threads",
    "ops",
    "set_cpu_isa",
    "set_num_threads",
    "to_torch",
    "wrap",
    "zeros",
]
