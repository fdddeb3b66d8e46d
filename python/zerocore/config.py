"""zerocore.Config: the knobs of a wrapped model, checked up front.

Every field has a default; a dict with the same keys works too. A wrong key
or value raises ValueError naming it and the fix, before anything is
allocated or communicated.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
from typing import Optional, Union

DTYPES = ("fp32", "bf16", "fp16")
OFFLOADS = (None, "cpu")
NCCLS = ("torch", "native")
SNAPSHOTS = (None, "memory")
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def _dtype_name(value, field: str) -> Optional[str]:
    if value is None:
        return None
    try:
        import torch

        if isinstance(value, torch.dtype):
            value = str(value).replace("torch.", "")
    except ImportError:  # pragma: no cover - torch is always there at run time
        pass
    name = _DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value
    if name not in DTYPES:
        raise ValueError(f"zerocore.Config: {field}={value!r} is not supported; use one of {', '.join(DTYPES)}")
    return name


def _timeout(value) -> Optional[datetime.timedelta]:
    """Config.timeout as a timedelta (None stays None)."""
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or seconds <= 0:
        raise ValueError(f"zerocore.Config: timeout={value!r}; use a positive number of seconds or a "
                         "datetime.timedelta, or None for the process group's own")
    return value if isinstance(value, datetime.timedelta) else datetime.timedelta(seconds=seconds)


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """fp16's dynamic loss scaling (ops/loss_scale.py): start at `initial`; an
    overflow (inf/NaN grads on any rank) skips the step, and once
    `hysteresis` overflows came without a scale increase between them the
    scale halves, never below `min_scale` (an overflow there raises); after
    `window` steps without overflow it doubles. consecutive_hysteresis: a
    clean step restores the hysteresis. deepspeed_growth: DeepSpeed's rule,
    whose first doubling after an overflow (or the start) comes after
    window + 1 clean steps. DeepSpeed's fp16 block maps onto these fields
    (initial = 2**initial_scale_power, deepspeed_growth=True)."""

    initial: float = 2.0**16
    window: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    consecutive_hysteresis: bool = False
    deepspeed_growth: bool = False

    def __post_init__(self):
        for name in ("initial", "min_scale"):
            if not _positive(getattr(self, name)):
                raise ValueError(f"zerocore.DynamicLossScale: {name}={getattr(self, name)!r}; use a positive number")
        for name in ("window", "hysteresis"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"zerocore.DynamicLossScale: {name}={v!r}; use an integer >= 1")
        if self.min_scale > self.initial:
            raise ValueError(f"zerocore.DynamicLossScale: min_scale={self.min_scale!r} is above "
                             f"initial={self.initial!r}")
        for name in ("consecutive_hysteresis", "deepspeed_growth"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"zerocore.DynamicLossScale: {name}={getattr(self, name)!r}; use True or False")


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of zerocore.wrap.

    stage: 0 (plain data parallelism), 1 (optimizer states partitioned),
        2 (+ gradients), 3 (+ parameters).
    dtype: training dtype of params, activations and grads: "fp32" (the
        default: wrapping changes no numerics unless asked), "bf16" or
        "fp16". With 16 bits an fp32 master copy lives in the optimizer.
    reduce_dtype: dtype of gradient buffers and reductions (default: dtype).
    loss_scale: "dynamic" (fp16: DynamicLossScale(): start at 2**16, halve
        on overflow, double after 2000 clean steps; other dtypes: no
        scaling), a DynamicLossScale with other settings, or a fixed number.
    max_grad_norm: clip gradients to this global norm (None: no clipping).
    bucket_bytes: size of the constant-size communication buckets.
    prefetch_bytes: stage 3: bytes of upcoming units to gather ahead of
        use; the next unit is always prefetched when this is > 0 (0: no
        prefetch).
    persist_threshold: stage 3: params with fewer elements stay whole on
        every rank (0 partitions all).
    coalesce_bytes: stage 3: consecutive units of one nn.Sequential are
        gathered and reduced as one unit while together they hold at most
        this many bytes (docs/runtime.md, "Fewer, larger collectives"): fewer, larger
        collectives, and a gather pool slot as large as the largest such
        run. None (the default): bucket_bytes; 0: every unit on its own.
    offload_optimizer: "cpu" (stages 1-3, ZeRO-Offload): the fp32 master
        params, the optimizer states and the step live on the host; the
        device keeps the params training reads (docs/offload.md). None: all
        on the device.
    offload_params: "cpu" (stage 3, with offload_optimizer="cpu"): the
        param shards live on the host too, fetched for each gather.
    delayed_update: with offload_optimizer: the one-step delayed parameter
        update. Step t's update runs on the host while the device computes
        step t+1's forward and backward, on params one step stale.
    delayed_update_warmup: steps that update without delay before it starts.
    timeout: how long a collective of the engine waits for its peers before
        raising zerocore.CollectiveTimeoutError (naming it) on every live
        rank: a datetime.timedelta or seconds. None (the default): the
        timeout of the process group given to wrap (init_process_group's),
        which the engine's own groups then take.
    diagnose_after: seconds a collective of the engine waits before reading
        where its peers are (zerocore/comm/positions.py): ranks in different
        collectives (one in full_state_dict(), another in its step) raise
        zerocore.RankDisagreementError on every rank involved, naming each
        rank's position; a peer that is only slow (computing, loading
        data) is waited for, until the timeout, whose error then says where
        it was. Every diagnose_after while the wait goes on, it looks again.
    nccl: on CUDA, what issues the data plane's collectives: "torch" (the
        default: torch.distributed's NCCL group, called from Python under
        the GIL) or "native" (zerocore's own NCCL communicator, which the
        comm queue's native threads call directly: zerocore/comm/nccl.py). The
        control plane stays on gloo either way. "native" needs a CUDA
        module and zerocore built with the transport (nccl.h at build time).
    snapshot: "memory": after every snapshot_every-th step each rank keeps
        what it owns in shared memory that outlives the process, mirrored on
        the next snapshot_copies nodes, and zerocore.wrap restores the newest step
        they hold at a restart (docs/snapshots.md). None: no snapshots.
    snapshot_dir: the node's folder of snapshots (default: under /dev/shm;
        it may differ from node to node);
        snapshot_run_id: the run they belong to (default: torchrun's
        TORCHELASTIC_RUN_ID).
    deterministic: the same bits at any world size (docs/deterministic.md):
        each engine.backward takes its micro-batch's own loss, unscaled, and
        the step's gradient is the mean over every micro-batch of every
        rank, summed exactly on a fixed-point grid.
    """

    stage: int = 3
    dtype: str = "fp32"
    reduce_dtype: Optional[str] = None
    loss_scale: Union[str, float, DynamicLossScale] = "dynamic"
    max_grad_norm: Optional[float] = None
    bucket_bytes: int = 25 * 2**20
    prefetch_bytes: int = 8 * 2**20
    persist_threshold: int = 0
    coalesce_bytes: Optional[int] = None
    offload_optimizer: Optional[str] = None
    offload_params: Optional[str] = None
    delayed_update: bool = False
    delayed_update_warmup: int = 40
    timeout: Optional[Union[datetime.timedelta, float]] = None
    diagnose_after: float = 5.0
    nccl: str = "torch"
    snapshot: Optional[str] = None
    snapshot_every: int = 1
    snapshot_copies: int = 1
    snapshot_dir: Optional[str] = None
    snapshot_run_id: Optional[str] = None
    deterministic: bool = False

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3) or isinstance(self.stage, bool):
            raise ValueError(f"zerocore.Config: stage={self.stage!r}; use 0, 1, 2 or 3")
        object.__setattr__(self, "dtype", _dtype_name(self.dtype, "dtype"))
        object.__setattr__(self, "reduce_dtype", _dtype_name(self.reduce_dtype, "reduce_dtype") or self.dtype)
        ls = self.loss_scale
        if ls == "dynamic":
            object.__setattr__(self, "loss_scale", DynamicLossScale())
        elif not (isinstance(ls, DynamicLossScale) or _positive(ls)):
            raise ValueError(f"zerocore.Config: loss_scale={ls!r}; use 'dynamic', a zerocore.DynamicLossScale or a "
                             "positive number")
        mgn = self.max_grad_norm
        if mgn is not None and not _positive(mgn):
            raise ValueError(f"zerocore.Config: max_grad_norm={mgn!r}; use a positive number or None")
        for name, lo in (("bucket_bytes", 1), ("prefetch_bytes", 0), ("persist_threshold", 0),
                         ("coalesce_bytes", 0), ("delayed_update_warmup", 0), ("snapshot_every", 1),
                         ("snapshot_copies", 1)):
            v = getattr(self, name)
            if name == "coalesce_bytes" and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"zerocore.Config: {name}={v!r}; use an integer >= {lo}")
        object.__setattr__(self, "timeout", _timeout(self.timeout))
        if not _positive(self.diagnose_after):
            raise ValueError(f"zerocore.Config: diagnose_after={self.diagnose_after!r}; use a positive number of "
                             "seconds")
        if self.nccl not in NCCLS:
            raise ValueError(f"zerocore.Config: nccl={self.nccl!r}; use \"torch\" (torch.distributed's NCCL) or "
                             "\"native\" (zerocore's own NCCL transport)")
        if self.snapshot not in SNAPSHOTS:
            raise ValueError(f"zerocore.Config: snapshot={self.snapshot!r}; use \"memory\" (in-memory snapshots "
                             "with peer mirrors, docs/snapshots.md) or None")
        for name in ("snapshot_dir", "snapshot_run_id"):
            if getattr(self, name) is not None and not (isinstance(getattr(self, name), str) and getattr(self, name)):
                raise ValueError(f"zerocore.Config: {name}={getattr(self, name)!r}; use a non-empty string or None")
        self._check_offload()
        self._check_deterministic()

    @property
    def coalesce_limit(self) -> int:
        """Bytes a run of coalesced stage-3 units holds at most."""
        return self.bucket_bytes if self.coalesce_bytes is None else self.coalesce_bytes

    def _check_offload(self):
        for name in ("offload_optimizer", "offload_params"):
            if getattr(self, name) not in OFFLOADS:
                raise ValueError(f"zerocore.Config: {name}={getattr(self, name)!r}; use None or \"cpu\"")
        if not isinstance(self.delayed_update, bool):
            raise ValueError(f"zerocore.Config: delayed_update={self.delayed_update!r}; use True or False")
        if self.offload_optimizer and self.stage == 0:
            raise ValueError("zerocore.Config: offload_optimizer=\"cpu\" needs stage 1, 2 or 3 (stage 0 keeps a "
                             "whole optimizer on every rank); set stage=1 or higher")
        if self.offload_params and (self.stage != 3 or not self.offload_optimizer):
            raise ValueError("zerocore.Config: offload_params=\"cpu\" needs stage=3 and offload_optimizer=\"cpu\" "
                             f"(got stage={self.stage}, offload_optimizer={self.offload_optimizer!r})")
        if self.delayed_update and not self.offload_optimizer:
            raise ValueError("zerocore.Config: delayed_update=True needs offload_optimizer=\"cpu\": the delayed "
                             "update hides the host step behind the device's next forward and backward")

    def _check_deterministic(self):
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"zerocore.Config: deterministic={self.deterministic!r}; use True or False")

    @classmethod
    def from_any(cls, config) -> "Config":
        """A Config from a Config, a dict of its fields, or None (defaults)."""
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        if isinstance(config, dict):
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(config) - fields)
            if unknown:
                raise ValueError(f"zerocore.Config: unknown key(s) {', '.join(map(repr, unknown))}; "
                                 f"valid keys are {', '.join(sorted(fields))}")
            return cls(**config)
        raise TypeError(f"zerocore.wrap: config must be a zerocore.Config or a dict, got {type(config).__name__}")

    @classmethod
    def from_deepspeed(cls, source, world_size=None) -> "Config":
        """The Config a DeepSpeed JSON config (a path or a dict) sets;
        zerocore.DeepSpeedConfig also builds its optimizer and scheduler
        and resolves its batch keys (integrations/deepspeed/config.py)."""
        from zerocore.integrations.deepspeed.config import DeepSpeedConfig

        return DeepSpeedConfig(source, world_size).config

    @property
    def delays_from(self) -> Optional[int]:
        """The first step whose update is delayed (None: none is)."""
        return self.delayed_update_warmup + 1 if self.delayed_update else None
