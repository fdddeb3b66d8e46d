"""Will it fit? zerocore.estimate and zerocore.largest_model (and the
`zerocore estimate` command): the model-state bytes each rank holds, per
stage, with and without offload, where they live (device and host), for a
model given as

- a param count ("7.5B", 125_000_000): the ZeRO formulas
  (zerocore.sizing.accounting.memory_coefficients), with no padding;
- a module, a function that builds one, or "module:function" naming one:
  it is built on the meta device (nothing allocated; zerocore.init()) and
  laid out by the engine's own planner, as zerocore.wrap would lay it out
  (units, alignment, buckets, params kept whole): the bytes are exactly
  what engine.memory_report() gives, padding included. Frozen params count
  as params only;
- a Hugging Face config.json (or its folder): the param count of the
  architectures listed in HF_ARCHITECTURES, computed from the config alone.

Model states only: activations, gradient reduction's and stage 3's gather
buffers (engine.memory_report()["comm_buffers"]) and the framework's own
memory come on top.
"""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

from zerocore.sizing import accounting
from zerocore.sizing.accounting import CATEGORIES, PLACES
from zerocore.sizing.models import Model, as_model
from zerocore.sizing.quantities import EstimateError, auto_unit, format_bytes, format_count, parse_bytes, unit_name

OFFLOADS = {"none": (False, False), "optimizer": (True, False), "params": (True, True)}
OFFLOAD_LABELS = {"none": "none", "optimizer": "optimizer", "params": "optimizer+params"}
OPTIMIZERS = ("adam", "adamw", "sgd")


# ------------------------------------------------------------------ the estimate


@dataclasses.dataclass
class Row:
    """Model-state bytes per rank for one world size, stage and offload."""

    world_size: int
    stage: int
    offload: str  # a key of OFFLOADS
    device: dict  # {"param", "grad", "optim"}: bytes on the device
    host: dict  # the same, on the host

    @property
    def device_bytes(self):
        return sum(self.device.values())

    @property
    def host_bytes(self):
        return sum(self.host.values())

    def total(self, category: str):
        return self.device[category] + self.host[category]

    def fits(self, memory, host_memory=None) -> bool:
        """Whether the model states fit in `memory` per device (and
        `host_memory` per rank on the host, when given)."""
        return self.device_bytes <= parse_bytes(memory) and \
            (host_memory is None or self.host_bytes <= parse_bytes(host_memory))


@dataclasses.dataclass
class Estimate:
    model: Model
    dtype: str
    optimizer: str
    momentum: bool
    layout: str  # "engine" (a module, padded as wrap lays it out) or "formula" (no padding)
    rows: list

    def row(self, world_size: int, stage: int, offload: str = "none") -> Row:
        for r in self.rows:
            if (r.world_size, r.stage, r.offload) == (world_size, stage, offload):
                return r
        raise KeyError(f"no estimate for world_size={world_size}, stage={stage}, offload={offload!r}")

    @property
    def state_bytes(self) -> int:
        """K without offload (docs/formulas.md)."""
        return accounting.optimizer_state_bytes(self.optimizer, self.dtype, self.momentum)

    def table(self, unit: str = None, memory=None, host_memory=None) -> str:
        """The rows in `unit` (a key of UNITS; None: the largest of B, KB,
        MB, GB, TB that shows the largest figure as 1 or more), with a
        "fits" column when memory (per device; host_memory per rank) is given."""
        m = self.model
        unit = unit or auto_unit(max((r.device_bytes + r.host_bytes for r in self.rows), default=0))
        what = f"{m.trainable:,} trainable params" + (f" and {m.frozen:,} frozen" if m.frozen else "")
        opt = self.optimizer + ("" if self.optimizer != "sgd" else " with momentum" if self.momentum
                                else " without momentum")
        how = ("laid out as zerocore.wrap lays it out, padding included" if self.layout == "engine"
               else "by the ZeRO formulas, no padding")
        fits = memory is not None
        head = ["ranks", "stage", "offload", "device", "host", "params", "grads", "optim"] + (["fits"] if fits else [])
        body = [[r.world_size, r.stage, OFFLOAD_LABELS[r.offload]]
                + [format_bytes(x, unit) for x in (r.device_bytes, r.host_bytes, *map(r.total, CATEGORIES))]
                + (["yes" if r.fits(memory, host_memory) else "no"] if fits else []) for r in self.rows]
        lines = [f"model:  {m.source}: {what}",
                 f"        {self.dtype}, {opt} ({_k_text(self.state_bytes, self.dtype)})",
                 f"model-state memory per rank, {unit_name(unit)}, {how}:",
                 *_columns(head, body, left={2})]
        if memory is not None:
            lines.append(f"  fits: the device's model states in {_given(memory)}"
                         + (f", the host's in {_given(host_memory)} a rank" if host_memory is not None else ""))
        lines.append(LEGEND)
        return "\n".join(lines)

    def __str__(self):
        return self.table()


LEGEND = """\
  device, host: the bytes on each (host: what offload moved there); params, grads, optim: the same bytes by
  category, wherever they live. Model states only: activations and the buffers collectives work in
  (engine.memory_report()["comm_buffers"]) come on top."""


def _columns(head: list, body: list, left=frozenset()) -> list:
    """Table lines: each column as wide as its widest cell, numbers to the
    right, the columns in `left` (indices) to the left."""
    cells = [[f"{x:,}" if isinstance(x, int) else str(x) for x in row] for row in [head] + body]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    return ["  " + "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            .rstrip() for row in cells]


def _given(memory) -> str:
    """A memory size as the user gave it."""
    return f"{memory:,} bytes" if isinstance(memory, int) else str(memory)


def _k_text(k: int, dtype: str) -> str:
    return f"K = {k} bytes of optimizer state a param" + (
        "; offloaded, 4 more: the host step's fp32 master" if dtype == "fp32" else "")


def _check(dtype, optimizer, stages, offload):
    from zerocore.config import _dtype_name

    dtype = _dtype_name(dtype, "dtype")
    if optimizer not in OPTIMIZERS:
        raise EstimateError(f"optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    bad = [s for s in stages if s not in (0, 1, 2, 3)] + [o for o in offload if o not in OFFLOADS]
    if bad:
        raise EstimateError(f"{bad[0]!r} is neither a stage (0-3) nor an offload ({', '.join(OFFLOADS)})")
    return dtype


def _combinations(world_sizes, stages, offload):
    """(world size, stage, offload) of every row: offload where the engine
    allows it (optimizer: stages 1-3; params: stage 3)."""
    for n in world_sizes:
        if not isinstance(n, int) or n < 1:
            raise EstimateError(f"world size {n!r}; use a positive integer")
        for s in stages:
            for o in offload:
                if (o == "optimizer" and s >= 1) or (o == "params" and s == 3) or o == "none":
                    yield n, s, o


def _engine_layout(module, config, world_size: int, state_names, units) -> dict:
    """{"device" | "host": {"param", "grad", "optim"}}: the bytes the flat
    groups zerocore.wrap would build hold on each rank: wrap's own plan
    (grouping.build_groups) and each group's buffer_plan, with no process
    group and no memory."""
    from zerocore import _native
    from zerocore.state.flat_group import TORCH_DTYPES
    from zerocore.state.exact_grads import planned_bytes
    from zerocore.state.grouping import build_groups, param_names
    from zerocore.state.placement import Placement

    # The stores only plan here: the backend they would allocate from is never used.
    comm = SimpleNamespace(world_size=world_size, rank=0, backend=_native.process_backend())
    groups, _ = build_groups(module, list(module.parameters()), param_names(module), {}, config=config,
                             placement=Placement.of(config), dtype=TORCH_DTYPES[config.dtype],
                             reduce_dtype=TORCH_DTYPES[config.reduce_dtype], comm=comm, state_names=state_names,
                             units=units)
    out = {at: dict.fromkeys(CATEGORIES, 0) for at in PLACES}
    for g in groups:
        for _, category, at, numel, dtype in g.buffer_plan():
            out[at][category] += numel * dtype.itemsize
    if config.deterministic:  # the grads' exact sums, which memory_report() counts as grads
        out["device"]["grad"] += planned_bytes(groups, Placement.of(config))
    return out


def _row_config(config, stage: int, dtype: str, offload_optimizer: bool, offload_params: bool):
    """The Config of one row: config's fields (a Config or a dict), with the
    row's stage, dtype and offload; its reduce_dtype where it names one of
    its own, and its delayed_update where the row offloads."""
    from zerocore.config import Config

    if isinstance(config, Config):
        fields = dataclasses.asdict(config)
        if config.reduce_dtype == config.dtype:
            fields["reduce_dtype"] = None
    else:
        fields = dict(config or {})
    fields.update(stage=stage, dtype=dtype, offload_optimizer="cpu" if offload_optimizer else None,
                  offload_params="cpu" if offload_params else None,
                  delayed_update=bool(fields.get("delayed_update")) and offload_optimizer)
    return Config.from_any(fields)


def estimate(model, world_size=1, dtype: str = "bf16", optimizer: str = "adamw", *, momentum: bool = True,
             stages=(0, 1, 2, 3), offload=tuple(OFFLOADS), config=None, units=None) -> Estimate:
    """Model-state bytes per rank of `model` (a param count like 7.5e9 or
    "7.5B", an nn.Module, a function building one, "module:function", or a
    Hugging Face config.json) trained with `optimizer` ("adam", "adamw",
    "sgd"; momentum: SGD's) in `dtype` on `world_size` ranks (an int or
    several), for each of `stages` and `offload` ("none", "optimizer",
    "params": optimizer and params, stage 3). A module is laid out as
    zerocore.wrap(model, opt, config, units=units) would lay it out, so the
    bytes equal engine.memory_report()'s; config's other fields
    (reduce_dtype, bucket_bytes, persist_threshold, delayed_update) apply,
    its stage, dtype and offload come from the arguments. str() of the
    result is a table; .row(world_size, stage, offload) one row."""
    from zerocore.engine.optimizer_bridge import state_names as optimizer_state_names

    dtype = _check(dtype, optimizer, stages, offload)
    m = as_model(model)
    worlds = [world_size] if isinstance(world_size, int) else list(world_size)
    state_names = optimizer_state_names(SimpleNamespace(kind=optimizer, param_groups=[{"momentum": momentum}]))
    rows = []
    for n, s, o in _combinations(worlds, stages, offload):
        off_opt, off_params = OFFLOADS[o]
        cfg = _row_config(config, s, dtype, off_opt, off_params)
        if m.module is not None:
            by = _engine_layout(m.module, cfg, n, state_names, units)
        else:
            k = accounting.optimizer_state_bytes(optimizer, dtype, momentum, offload=off_opt)
            by = accounting.predicted_memory_by_device(
                s, m.trainable, n, dtype, k, frozen_numel=m.frozen, reduce_dtype=cfg.reduce_dtype,
                offload_optimizer=off_opt, offload_params=off_params, delayed_update=cfg.delayed_update)
        rows.append(Row(n, s, o, by["device"], by["host"]))
    return Estimate(m, dtype, optimizer, momentum, "engine" if m.module is not None else "formula", rows)


def largest_model(memory, world_size: int = 1, stage: int = 3, offload: str = "none", dtype: str = "bf16",
                  optimizer: str = "adamw", *, momentum: bool = True, host_memory=None, granularity: int = 1,
                  reduce_dtype: str = None, delayed_update: bool = False):
    """The most trainable params (a multiple of granularity) whose model
    states, by the ZeRO formulas, fit in `memory` per device ("80GB", or
    bytes) at `world_size` ranks, `stage` and `offload` (as in estimate),
    and in host_memory per rank on the host when given: estimate(n) fits
    and estimate(n + granularity) does not. math.inf when nothing bounds it
    (offload moved every model state to a host of unstated size)."""
    from zerocore.config import _dtype_name

    dtype = _check(dtype, optimizer, [stage], [offload])
    if not list(_combinations([world_size], [stage], [offload])):
        raise EstimateError(f"stage {stage} cannot offload {OFFLOAD_LABELS[offload]} "
                            "(optimizer: stages 1-3; params: stage 3)")
    off_opt, off_params = OFFLOADS[offload]
    k = accounting.optimizer_state_bytes(optimizer, dtype, momentum, offload=off_opt)
    return accounting.largest_numel(
        parse_bytes(memory), stage, world_size, dtype, k,
        host_memory=None if host_memory is None else parse_bytes(host_memory), granularity=granularity,
        reduce_dtype=_dtype_name(reduce_dtype, "reduce_dtype"), offload_optimizer=off_opt,
        offload_params=off_params, delayed_update=delayed_update and off_opt)


def largest_table(memory, world_sizes, dtype="bf16", optimizer="adamw", *, momentum=True, stages=(0, 1, 2, 3),
                  offload=tuple(OFFLOADS), host_memory=None) -> str:
    """The table `zerocore estimate --memory M` prints without a model."""
    dtype = _check(dtype, optimizer, stages, offload)
    k = accounting.optimizer_state_bytes(optimizer, dtype, momentum)
    where = f"{_given(memory)} per device" + (f" and {_given(host_memory)} of host memory a rank"
                                              if host_memory is not None else "")
    body = []
    for n, s, o in _combinations(world_sizes, stages, offload):
        best = largest_model(memory, n, s, o, dtype, optimizer, momentum=momentum, host_memory=host_memory)
        body.append([n, s, OFFLOAD_LABELS[o], format_count(best) if best != math.inf
                     else "no limit (all model states on the host)"])
    lines = [f"the largest model whose model states fit in {where}, by the ZeRO formulas:",
             f"        {dtype}, {optimizer} ({_k_text(k, dtype)})",
             *_columns(["ranks", "stage", "offload", "trainable params"], body, left={2, 3})]
    lines.append("  Model states only: activations and the buffers collectives work in come on top.")
    return "\n".join(lines)
