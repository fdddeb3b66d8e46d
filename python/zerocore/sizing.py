"""Will it fit? zerocore.estimate and zerocore.largest_model (and the
`zerocore estimate` command): the model-state bytes each rank holds, per
stage, with and without offload, where they live (device and host), for a
model given as

- a param count ("7.5B", 125_000_000): the ZeRO formulas
  (zerocore.accounting.memory_coefficients), with no padding;
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
import decimal
import importlib
import json
import math
import os
import re
import sys
from types import SimpleNamespace

from zerocore import accounting
from zerocore.accounting import CATEGORIES, PLACES

OFFLOADS = {"none": (False, False), "optimizer": (True, False), "params": (True, True)}
OFFLOAD_LABELS = {"none": "none", "optimizer": "optimizer", "params": "optimizer+params"}
OPTIMIZERS = ("adam", "adamw", "sgd")
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


class EstimateError(ValueError):
    """A model or a size that cannot be estimated; the message says why."""


# ------------------------------------------------------------------ sizes


def _decimal(text: str, what: str) -> decimal.Decimal:
    try:
        value = decimal.Decimal(text.replace("_", "").replace(",", ""))
    except decimal.InvalidOperation:
        raise EstimateError(f"{what}: {text!r} is not a number") from None
    if not value.is_finite() or value < 0:
        raise EstimateError(f"{what}: {text!r} is not a non-negative number")
    return value


def parse_count(text) -> int:
    """A param count: 7500000000, "7.5B", "125M", "350K", "1.3e9"."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*([\d_.,eE+]+)\s*([kKmMbBtT]?)\s*", str(text))
    if not m:
        raise EstimateError(f"{text!r} is not a param count (use 7500000000, 7.5B, 125M or 350K)")
    return int(_decimal(m.group(1), "param count") * _COUNT_SUFFIX[m.group(2).upper()])


def parse_bytes(text) -> int:
    """A memory size with its unit: "80GB", "80 GiB", "512MiB", "1.5TB", "4096B"
    (KB, MB, GB, TB are powers of 10; KiB, MiB, GiB, TiB of 2). An int is bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*([\d_.,eE+]+)\s*([A-Za-z]+)\s*", str(text))
    unit = m and {u.lower(): u for u in UNITS}.get(m.group(2).lower())
    if not unit:
        raise EstimateError(f"{text!r} is not a memory size; give a number and a unit: "
                            f"{', '.join(UNITS)} (80GB, 80GiB)")
    return int(_decimal(m.group(1), "memory") * UNITS[unit])


def format_bytes(n, unit: str = "GB") -> str:
    """n bytes in `unit`, to 3 significant figures (the ZeRO paper's style;
    at least the whole units): 120, 31.4, 1.88, 0.0312."""
    if unit == "B":
        return f"{int(n):,}"
    v = n / UNITS[unit]
    if v >= 100 or v == 0:
        return f"{v:,.0f}"
    return f"{v:.{max(0, 2 - math.floor(math.log10(v)))}f}"


def auto_unit(n) -> str:
    """The largest decimal unit in which n bytes are 1 or more."""
    return next((u for u in ("TB", "GB", "MB", "KB") if n >= UNITS[u]), "B")


def format_count(n) -> str:
    """7,500,000,000 (7.5B)."""
    if n == math.inf:
        return "no limit"
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n:,} ({n / scale:.3g}{suffix})"
    return f"{n:,}"


# ------------------------------------------------------------------ Hugging Face configs


def _gpt2(c) -> int:
    d, layers, vocab = c["n_embd"], c["n_layer"], c["vocab_size"]
    positions = c["n_positions"] if "n_positions" in c else c["n_ctx"]
    inner = c.get("n_inner") or 4 * d
    # ln_1, attention (c_attn, c_proj, with biases), ln_2, mlp (c_fc, c_proj, with biases)
    layer = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * inner + inner) + (inner * d + d)
    head = 0 if c.get("tie_word_embeddings", True) else vocab * d
    return vocab * d + positions * d + layers * layer + 2 * d + head


def _llama(c) -> int:
    d, inner, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or d // heads
    attn = 2 * d * heads * hd + 2 * d * kv * hd  # q, o; k, v
    if c.get("attention_bias", False):
        attn += heads * hd + 2 * kv * hd + d
    mlp = 3 * d * inner + ((2 * inner + d) if c.get("mlp_bias", False) else 0)  # gate, up, down
    head = 0 if c.get("tie_word_embeddings", False) else vocab * d
    return vocab * d + layers * (attn + mlp + 2 * d) + d + head  # two RMSNorms a layer, the final one


HF_ARCHITECTURES = {"gpt2": _gpt2, "llama": _llama, "mistral": _llama}


def hf_param_count(config) -> int:
    """Params of the Hugging Face model a config.json describes (a dict, or
    the path of the file or of its folder), without transformers: the
    model_types of HF_ARCHITECTURES."""
    if not isinstance(config, dict):
        path = os.path.join(config, "config.json") if os.path.isdir(config) else config
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise EstimateError(f"cannot read the Hugging Face config {path}: {e}") from None
    kind = config.get("model_type")
    count = HF_ARCHITECTURES.get(kind)
    if count is None:
        raise EstimateError(f"model_type {kind!r} is not one zerocore estimate counts from a config.json; it knows "
                            f"{', '.join(HF_ARCHITECTURES)}. For another model, name a function that builds it, "
                            "as module:function (it is built on the meta device, so nothing is allocated)")
    try:
        return count(config)
    except KeyError as e:
        raise EstimateError(f"the {kind} config.json has no {e.args[0]!r}") from None


# ------------------------------------------------------------------ models


@dataclasses.dataclass
class Model:
    """What is estimated: a param count (formula) or a module (its layout)."""

    trainable: int
    frozen: int = 0
    module: object = None  # an nn.Module, laid out as the engine lays it out
    source: str = ""

    @property
    def params(self) -> int:
        return self.trainable + self.frozen


def _build_on_meta(fn, name: str):
    import torch

    with torch.device("meta"):
        try:
            module = fn()
        except TypeError as e:
            raise EstimateError(f"{name}() failed: {e} (the function is called with no arguments)") from None
    if not isinstance(module, torch.nn.Module):
        raise EstimateError(f"{name}() returned a {type(module).__name__}, not a torch.nn.Module")
    return module


def _import_function(spec: str):
    mod_name, _, fn_name = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise EstimateError(f"{spec}: cannot import {mod_name}: {e}") from None
    obj = mod
    for part in fn_name.split("."):
        if not hasattr(obj, part):
            raise EstimateError(f"{spec}: {mod_name} has no {fn_name}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise EstimateError(f"{spec}: {fn_name} is not callable")
    return obj


def as_model(model) -> Model:
    """A Model from a param count, an nn.Module, a function building one,
    "module:function", or a Hugging Face config.json (its path or folder)."""
    if isinstance(model, Model):
        return model
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        return Model(int(model), source="a param count")
    import torch

    if isinstance(model, torch.nn.Module):
        params = list(model.parameters())
        trainable = sum(p.numel() for p in params if p.requires_grad)
        return Model(trainable, sum(p.numel() for p in params) - trainable, model, f"a {type(model).__name__}")
    if callable(model):
        name = getattr(model, "__qualname__", repr(model))
        return dataclasses.replace(as_model(_build_on_meta(model, name)), source=f"{name}() on the meta device")
    if isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
        if os.path.exists(text) or text.endswith(".json"):
            return Model(hf_param_count(text), source=f"the Hugging Face config {text}")
        if re.fullmatch(r"[\w.]+:[\w.]+", text):
            built = as_model(_build_on_meta(_import_function(text), text))
            return dataclasses.replace(built, source=f"{text}() on the meta device")
        return Model(parse_count(text), source="a param count")
    raise EstimateError(f"cannot estimate a {type(model).__name__}; give a param count, a torch.nn.Module, a "
                        "function that builds one, 'module:function', or a Hugging Face config.json")


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
                 f"model-state memory per rank, {_unit_name(unit)}, {how}:",
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


def _unit_name(unit: str) -> str:
    """GB (10^9 bytes), GiB (2^30 bytes)."""
    if unit == "B":
        return "bytes"
    n = UNITS[unit]
    return f"{unit} (2^{n.bit_length() - 1} bytes)" if unit.endswith("iB") else f"{unit} (10^{len(str(n)) - 1} bytes)"


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
    from zerocore.exact_grads import planned_bytes
    from zerocore.flat_group import TORCH_DTYPES
    from zerocore.grouping import build_groups, param_names
    from zerocore.placement import Placement

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
    from zerocore.optim import state_names as optimizer_state_names

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


# ------------------------------------------------------------------ the command


def add_arguments(p) -> None:
    """`zerocore estimate`'s arguments, on an argparse parser."""
    p.add_argument("model", nargs="?",
                   help="a param count (7.5B, 125M, 7500000000), module:function building the model (called "
                        "with no arguments on the meta device: nothing is allocated), or a Hugging Face "
                        f"config.json or its folder (model_type {', '.join(HF_ARCHITECTURES)}); leave it out "
                        "with --memory for the largest model that fits")
    p.add_argument("--ranks", type=int, nargs="+", default=[1], metavar="N",
                   help="data-parallel world size(s) (default: 1)")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"),
                   help="training dtype (16 bits: an fp32 master copy in the optimizer) (default: bf16)")
    p.add_argument("--reduce-dtype", default=None, choices=("fp32", "bf16", "fp16"),
                   help="dtype of the gradient buffers (default: --dtype)")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="(default: adamw)")
    p.add_argument("--no-momentum", action="store_true", help="sgd without momentum (no optimizer state)")
    p.add_argument("--stage", type=int, nargs="+", default=[0, 1, 2, 3], choices=(0, 1, 2, 3),
                   help="ZeRO stage(s) (default: 0 1 2 3)")
    p.add_argument("--offload", nargs="+", default=list(OFFLOADS), choices=list(OFFLOADS),
                   help="none; optimizer (offload_optimizer='cpu', stages 1-3); params (and offload_params='cpu', "
                        "stage 3) (default: all three)")
    p.add_argument("--delayed-update", action="store_true",
                   help="offloaded: the delayed update's second host grad buffer (stages 2-3)")
    p.add_argument("--memory", default=None,
                   help="memory per device, with a unit (80GB, 80GiB): with a model, whether it fits; without, "
                        "the largest model that fits")
    p.add_argument("--host-memory", default=None, help="host memory per rank, with a unit, for the same questions")
    p.add_argument("--unit", default=None, choices=list(UNITS),
                   help="unit of the table (default: the largest of B, KB, MB, GB, TB that shows the largest "
                        "figure as 1 or more)")
    p.add_argument("--bucket-bytes", type=int, default=None,
                   help="module:function: Config.bucket_bytes of the layout (default: the engine's)")
    p.add_argument("--persist-threshold", type=int, default=None,
                   help="module:function: Config.persist_threshold of the layout (default: the engine's)")


def run(args) -> str:
    """What `zerocore estimate` prints for parsed arguments."""
    if args.model is None:
        if args.memory is None:
            raise EstimateError("give a model (a param count, module:function or config.json), or --memory for "
                                "the largest model that fits")
        if args.reduce_dtype is not None or args.delayed_update:
            raise EstimateError("--reduce-dtype and --delayed-update apply to a model's estimate only")
        return largest_table(args.memory, args.ranks, args.dtype, args.optimizer, momentum=not args.no_momentum,
                             stages=args.stage, offload=args.offload, host_memory=args.host_memory)
    config = {"reduce_dtype": args.reduce_dtype, "bucket_bytes": args.bucket_bytes,
              "persist_threshold": args.persist_threshold, "delayed_update": args.delayed_update}
    config = {k: v for k, v in config.items() if v not in (None, False)}
    sys.path.insert(0, os.getcwd())  # module:function may name a module of the current folder, as python -m does
    try:
        est = estimate(args.model, args.ranks, args.dtype, args.optimizer, momentum=not args.no_momentum,
                       stages=args.stage, offload=args.offload, config=config or None)
    finally:
        sys.path.remove(os.getcwd())
    return est.table(args.unit, args.memory, args.host_memory)
