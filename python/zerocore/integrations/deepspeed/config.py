"""DeepSpeed JSON configs, read as DeepSpeed reads them.

    ds = zerocore.DeepSpeedConfig("ds_config.json")      # or a dict
    opt = ds.optimizer(model.parameters())               # the "optimizer" block
    scheduler = ds.scheduler(opt)                        # the "scheduler" block
    engine = zerocore.wrap(model, opt, ds.config)        # a zerocore.Config
    ds.gradient_accumulation_steps, ds.micro_batch_size  # the batch keys, resolved

zerocore.Config.from_deepspeed(source) is ds.config alone. Every key is
accounted for: one that maps onto zerocore sets what it names; one that
changes no result in zerocore (logging, profiling, DeepSpeed's own
scheduling and memory knobs, where zerocore plans its own) is listed once
in a warning; one that would change training and that zerocore does not do
(NVMe offload, quantized collectives, apex amp, ...), and any key zerocore
does not know, is an error naming it. A block that is present but disabled
("enabled": false) changes nothing and is not listed.

DeepSpeed's semantics kept here:
- Batch keys: train_batch_size = train_micro_batch_size_per_gpu *
  gradient_accumulation_steps * world size; two of them give the third
  (rounding down, as DeepSpeed does), one gives the rest with accumulation
  1, and all three must agree. "auto" counts as not given.
- Optimizer "Adam" and "AdamW" are DeepSpeed's fused Adam: AdamW's
  decoupled weight decay unless "adam_w_mode": false, and its defaults (lr
  1e-3, weight_decay 0); "torch_adam": true takes torch's defaults. Any
  other type is the torch.optim class of that name (SGD).
- fp16: "loss_scale" 0 is dynamic scaling from 2**initial_scale_power, with
  DeepSpeed's loss_scale_window (1000), hysteresis (2), min_loss_scale (1),
  consecutive_hysteresis and its rule for when the scale grows; any other
  value a fixed scale.
- Sizes in elements: reduce_bucket_size and stage3_prefetch_bucket_size
  become bytes at the reduce and training dtypes' widths;
  stage3_param_persistence_threshold keeps params of at most that many
  elements whole, as DeepSpeed does.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Optional

import torch

from zerocore.config import Config, DynamicLossScale
from zerocore.integrations.deepspeed.schedules import SCHEDULES

# Keys that change no result in zerocore, with why.
_NO_EFFECT_TOP = {
    **dict.fromkeys(["steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown", "flops_profiler",
                     "tensorboard", "wandb", "csv_monitor", "comet", "monitor", "comms_logger", "timers",
                     "autotuning"], "logging and profiling"),
    **dict.fromkeys(["checkpoint", "use_node_local_storage", "load_universal_checkpoint"],
                    "DeepSpeed's checkpoint files (zerocore's: engine.save)"),
    **dict.fromkeys(["zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"],
                    "DeepSpeed's optimizer choice (zerocore runs its own)"),
    "activation_checkpointing": "configures deepspeed.checkpointing (zerocore's: zerocore.checkpoint in the model)",
    "sparse_gradients": "sparse embedding grads (zerocore reduces them dense)",
}
_NO_EFFECT_ZERO = {
    **dict.fromkeys(["contiguous_gradients", "reduce_scatter", "use_multi_rank_bucket_allreduce",
                     "allgather_partitions", "allgather_bucket_size", "overlap_comm", "round_robin_gradients",
                     "sub_group_size", "stage3_max_live_parameters", "max_live_parameters",
                     "stage3_max_reuse_distance", "max_reuse_distance", "stage3_model_persistence_threshold",
                     "model_persistence_threshold", "stage3_module_granularity_threshold",
                     "module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
                     "use_all_reduce_for_fetch_params", "stage3_allgather_sequential", "allgather_sequential",
                     "memory_efficient_linear", "parameter_alignment", "legacy_stage1", "leaf_module",
                     "override_module_apply", "compute_grad_norm", "pipeline_loading_checkpoint",
                     "log_trace_cache_warnings", "enable_sanity_checks"],
                    "DeepSpeed's own scheduling and memory knobs (zerocore plans its own)"),
    **dict.fromkeys(["load_from_fp32_weights", "elastic_checkpoint", "stage3_gather_16bit_weights_on_model_save",
                     "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                     "save_muon_momentum_buffer_in_memory"], "DeepSpeed's checkpoint files (zerocore's: engine.save)"),
    "cpu_offload_use_pin_memory": "pinned host memory (zerocore pins where a GPU needs it)",
}
# Keys that would change training, that zerocore does not do, with why.
_NOT_DONE_ZERO = {
    "zero_hpz_partition_size": (1, "ZeRO++'s hierarchical partitioning"),
    "zero_quantized_weights": (False, "ZeRO++'s quantized weights"),
    "zero_quantized_nontrainable_weights": (False, "ZeRO++'s quantized weights"),
    "zero_quantized_gradients": (False, "ZeRO++'s quantized gradients"),
    "ignore_unused_parameters": (True, "raising on unused params (zerocore gives them zero grads)"),
    "zenflow": (None, "ZenFlow's stale-gradient offload"),
    "mics_shard_size": (-1, "MiCS partitioning"),
}
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# ZeRO sizes whose "auto" is zerocore's own default (zerocore plans them; no result changes).
_SIZES = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "prefetch_bucket_size",
          "stage3_param_persistence_threshold", "param_persistence_threshold")


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config zerocore cannot train as DeepSpeed would."""


def read_json(path) -> dict:
    """The DeepSpeed config in the JSON file at `path`."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DeepSpeedConfigError(f"zerocore: cannot read the DeepSpeed config {os.fspath(path)}: {e}") from e


def fill_auto(raw: dict, values: dict) -> dict:
    """A copy of the DeepSpeed config `raw` with each "auto" at a path in
    `values` ((key, subkey, ...) -> value) set to that value."""
    out = dict(raw)
    for path, value in values.items():
        block = out
        for key in path[:-1]:
            if not isinstance(block.get(key), dict):
                break
            block[key] = block = dict(block[key])
        else:
            if block.get(path[-1]) == "auto":
                block[path[-1]] = value
    return out


def _load(source) -> dict:
    if isinstance(source, dict):
        return source
    if isinstance(source, (str, os.PathLike)):
        return read_json(source)
    raise TypeError(f"zerocore: a DeepSpeed config is a path or a dict, got {type(source).__name__}")


def _enabled(block) -> bool:
    return not (isinstance(block, dict) and block.get("enabled") is False)


class DeepSpeedConfig:
    """A DeepSpeed config read for zerocore (see the module docstring).

    config: the zerocore.Config it sets. train_batch_size, micro_batch_size
    (train_micro_batch_size_per_gpu) and gradient_accumulation_steps, as
    DeepSpeed resolves them for `world_size` (default: the initialised
    process group's, else 1). optimizer(params) and scheduler(optimizer)
    build what its blocks name (None without one)."""

    def __init__(self, source, world_size: Optional[int] = None):
        raw = _load(source)
        unresolved = [".".join(path) for path in _autos(raw) if not _auto_resolved(raw, path)]
        if unresolved:
            raise DeepSpeedConfigError(
                f"zerocore: the DeepSpeed config sets {', '.join(unresolved)} to \"auto\", which the Hugging Face "
                "Trainer fills from its TrainingArguments (so does zerocore's ZeroTrainer, given the config as "
                "zero_config=); outside it zerocore cannot tell what they should be: give their values")
        if world_size is None:
            world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.world_size = world_size
        self._ignored = {}  # why -> the keys ignored for it
        self._optimizer_block = raw.get("optimizer")
        self._scheduler_block = raw.get("scheduler")
        fields = {}
        for key, value in raw.items():
            self._read_top(key, value, fields)
        self.train_batch_size, self.micro_batch_size, self.gradient_accumulation_steps = \
            self._batch({k: raw.get(k) for k in _BATCH_KEYS})
        try:
            self.config = Config(**fields)
        except ValueError as e:
            raise DeepSpeedConfigError(f"zerocore: the DeepSpeed config maps to an invalid zerocore.Config: {e}") \
                from e
        if self._ignored:
            warnings.warn("zerocore: these DeepSpeed config keys change nothing in zerocore and are ignored: " +
                          "; ".join(f"{', '.join(keys)} ({why})" for why, keys in self._ignored.items()),
                          stacklevel=2)

    def _ignore(self, key, why):
        self._ignored.setdefault(why, []).append(key)

    # Keys ------------------------------------------------------------------
    def _read_top(self, key, value, fields):
        if key in _BATCH_KEYS or key in ("optimizer", "scheduler"):
            return  # read below, or built on request
        if key in _NO_EFFECT_TOP:
            if _enabled(value):
                self._ignore(key, _NO_EFFECT_TOP[key])
        elif key == "gradient_clipping":
            clip = _given(key, value, default=0.0)
            fields["max_grad_norm"] = clip if clip else None
        elif key in ("fp16", "bf16", "bfloat16"):
            self._read_precision(key, value, fields)
        elif key == "communication_data_type":
            if value is not None:
                fields["reduce_dtype"] = _given(key, value)
        elif key == "zero_optimization":
            self._read_zero(value, fields)
        elif key == "prescale_gradients" and value is False or key == "gradient_predivide_factor" and value == 1.0:
            pass  # DeepSpeed's defaults: grads summed, then divided once, as zerocore does
        elif isinstance(value, dict) and not _enabled(value):
            pass
        else:
            raise DeepSpeedConfigError(f"zerocore: the DeepSpeed config key {key!r} would change training and "
                                       "zerocore does not implement it; remove it to train with zerocore")

    def _read_precision(self, key, block, fields):
        if not _given(f"{key}.enabled", block.get("enabled", False)):
            return
        dtype = "fp16" if key == "fp16" else "bf16"
        if fields.get("dtype", dtype) != dtype:
            raise DeepSpeedConfigError("zerocore: the DeepSpeed config enables both fp16 and bf16; enable one")
        fields["dtype"] = dtype
        known = {"enabled"}
        if dtype == "fp16":
            known |= {"loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                      "consecutive_hysteresis", "min_loss_scale", "auto_cast", "fp16_master_weights_and_grads"}
            for flag in ("auto_cast", "fp16_master_weights_and_grads"):
                if block.get(flag):
                    raise DeepSpeedConfigError(f"zerocore: fp16.{flag} would change training and zerocore does "
                                               "not implement it; remove it to train with zerocore")
            scale = _given("fp16.loss_scale", block.get("loss_scale", 0))
            fields["loss_scale"] = float(scale) if scale else DynamicLossScale(
                initial=2.0 ** _given("fp16.initial_scale_power", block.get("initial_scale_power", 16)),
                window=_given("fp16.loss_scale_window", block.get("loss_scale_window", 1000)),
                hysteresis=_given("fp16.hysteresis", block.get("hysteresis", 2)),
                min_scale=float(_given("fp16.min_loss_scale", block.get("min_loss_scale", 1))),
                consecutive_hysteresis=_given("fp16.consecutive_hysteresis",
                                              block.get("consecutive_hysteresis", False)),
                deepspeed_growth=True)
        unknown = sorted(set(block) - known)
        if unknown:
            raise DeepSpeedConfigError(f"zerocore: the DeepSpeed config keys {key}.{', '.join(unknown)} would "
                                       "change training and zerocore does not implement them; remove them")

    def _read_zero(self, zero, fields):
        zero = dict(zero)
        stage = _given("zero_optimization.stage", zero.pop("stage", 0))
        fields["stage"] = int(stage)
        if zero.pop("cpu_offload", False):  # DeepSpeed's older spelling
            zero.setdefault("offload_optimizer", {"device": "cpu"})
        if zero.pop("cpu_offload_param", False):
            zero.setdefault("offload_param", {"device": "cpu"})
        for block, field in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_params")):
            device = self._offload(block, zero.pop(block, None))
            if device:
                fields[field] = device
        reduce_width = {"fp32": 4}.get(fields.get("reduce_dtype", fields.get("dtype", "fp32")), 2)
        width = {"fp32": 4}.get(fields.get("dtype", "fp32"), 2)
        # DeepSpeed keeps a param of at most the persistence threshold's
        # elements whole (partition_parameters.py: ds_numel <= threshold);
        # zerocore one of fewer than its persist_threshold.
        for names, field, to_zerocore in (
                (("reduce_bucket_size",), "bucket_bytes", lambda n: n * reduce_width),
                (("stage3_prefetch_bucket_size", "prefetch_bucket_size"), "prefetch_bytes", lambda n: n * width),
                (("stage3_param_persistence_threshold", "param_persistence_threshold"), "persist_threshold",
                 lambda n: n + 1 if n > 0 else 0)):
            for name in names:
                value = zero.pop(name, None)
                if value is not None and value != "auto":  # "auto": zerocore's own default (changes no result)
                    fields[field] = to_zerocore(int(_given(f"zero_optimization.{name}", value)))
        for key, value in zero.items():
            if key in _NO_EFFECT_ZERO:
                self._ignore(f"zero_optimization.{key}", _NO_EFFECT_ZERO[key])
            elif key in _NOT_DONE_ZERO and value == _NOT_DONE_ZERO[key][0]:
                pass  # DeepSpeed's default: nothing to do
            elif key in _NOT_DONE_ZERO:
                raise DeepSpeedConfigError(f"zerocore: zero_optimization.{key}={value!r} asks for "
                                           f"{_NOT_DONE_ZERO[key][1]}, which zerocore does not implement; remove it")
            else:
                raise DeepSpeedConfigError(f"zerocore: the DeepSpeed config key zero_optimization.{key} is not one "
                                           "zerocore knows; remove it to train with zerocore")

    def _offload(self, name, block) -> Optional[str]:
        """The offload device ("cpu" or None) of an offload block."""
        if not block:
            return None
        block = dict(block)
        device = _given(f"zero_optimization.{name}.device", block.pop("device", "none"))
        if device == "nvme":
            raise DeepSpeedConfigError(f"zerocore: zero_optimization.{name}.device='nvme' (ZeRO-Infinity's NVMe "
                                       "offload) is not implemented in zerocore; use \"cpu\"")
        if device not in ("cpu", "none"):
            raise DeepSpeedConfigError(f"zerocore: zero_optimization.{name}.device={device!r}; use \"cpu\" or "
                                       "\"none\"")
        if block.pop("ratio", 1.0) != 1.0:
            raise DeepSpeedConfigError(f"zerocore: zero_optimization.{name}.ratio (a partial offload) is not "
                                       "implemented in zerocore; remove it")
        for key in block:  # pin_memory, and the NVMe path's buffers and pipelines
            self._ignore(f"zero_optimization.{name}.{key}", "pinning and NVMe buffers")
        return "cpu" if device == "cpu" else None

    def _batch(self, given):
        """DeepSpeed's resolution of the three batch keys for the world size."""
        train, micro, accum = (None if v in (None, "auto") else _given(k, v) for k, v in given.items())
        world = self.world_size
        if train is not None and micro is not None and accum is None:
            accum = train // micro // world
        elif train is not None and accum is not None and micro is None:
            micro = train // world // accum
        elif micro is not None and accum is not None and train is None:
            train = micro * accum * world
        elif train is not None and micro is None and accum is None:
            micro, accum = train // world, 1
        elif micro is not None and train is None and accum is None:
            train, accum = micro * world, 1
        elif train is None and micro is None:
            raise DeepSpeedConfigError("zerocore: the DeepSpeed config gives neither train_batch_size nor "
                                       "train_micro_batch_size_per_gpu; give one")
        if not (train > 0 and micro > 0 and accum > 0) or train != micro * accum * world:
            raise DeepSpeedConfigError(
                f"zerocore: the DeepSpeed config's batch keys disagree: train_batch_size {train} must equal "
                f"train_micro_batch_size_per_gpu {micro} * gradient_accumulation_steps {accum} * world size "
                f"{world}, each above 0")
        return train, micro, accum

    # What the blocks build ---------------------------------------------------
    def optimizer(self, params) -> Optional[torch.optim.Optimizer]:
        """The optimizer the "optimizer" block names, over `params`, with
        DeepSpeed's semantics; None without the block."""
        block = self._optimizer_block
        if block is None:
            return None
        kind = _given("optimizer.type", block.get("type"))
        args = {k: _given(f"optimizer.params.{k}", v) for k, v in (block.get("params") or {}).items()}
        if "max_grad_norm" in args:
            raise DeepSpeedConfigError("zerocore: optimizer.params.max_grad_norm is not supported (nor by "
                                       "DeepSpeed); use the top-level gradient_clipping")
        if str(kind).lower() in ("adam", "adamw"):
            decoupled = str(kind).lower() == "adamw" or args.pop("adam_w_mode", True)
            if args.pop("torch_adam", False):
                cls = torch.optim.AdamW if decoupled else torch.optim.Adam
                return cls(params, **args)
            if not args.pop("bias_correction", True):
                raise DeepSpeedConfigError("zerocore: optimizer.params.bias_correction=false is not implemented in "
                                           "zerocore (its Adam always corrects the moments' bias)")
            args.pop("fp32_optimizer_states", None)  # zerocore's optimizer states are fp32
            fused = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)  # DeepSpeed's fused Adam
            return (torch.optim.AdamW if decoupled else torch.optim.Adam)(params, **{**fused, **args})
        if kind == "SGD":
            return torch.optim.SGD(params, **args)
        raise DeepSpeedConfigError(f"zerocore: optimizer type {kind!r}: zerocore trains with Adam, AdamW or SGD")

    def scheduler(self, optimizer):
        """The LR scheduler the "scheduler" block names, on `optimizer`, with
        DeepSpeed's rates (integrations/deepspeed/schedules.py); None without the block.
        Call its step() after each engine.step() that applied (DeepSpeed's
        engine does not step it after a step an fp16 overflow skipped)."""
        block = self._scheduler_block
        if block is None:
            return None
        kind = _given("scheduler.type", block.get("type"))
        if kind not in SCHEDULES:
            raise DeepSpeedConfigError(f"zerocore: scheduler type {kind!r}: zerocore builds "
                                       f"{', '.join(SCHEDULES)}")
        args = {k: _given(f"scheduler.params.{k}", v) for k, v in (block.get("params") or {}).items()}
        if args.pop("last_batch_iteration", -1) != -1:
            raise DeepSpeedConfigError("zerocore: scheduler.params.last_batch_iteration: resume a scheduler with "
                                       "engine.load(path, lr_scheduler=scheduler) instead")
        try:
            return SCHEDULES[kind](optimizer, **args)
        except TypeError as e:
            raise DeepSpeedConfigError(f"zerocore: scheduler {kind}: {e}") from e


def _autos(value, path=()):
    """The paths (tuples of keys) of every "auto" in a config."""
    if value == "auto":
        yield path
    elif isinstance(value, dict):
        for key, v in value.items():
            yield from _autos(v, path + (key,))


def _auto_resolved(raw, path) -> bool:
    """Whether the "auto" at `path` needs no value: a batch key (DeepSpeed
    resolves it from the others), a ZeRO size (zerocore's own), or a key
    that changes nothing (ignored, or in a disabled block)."""
    top = path[0]
    if len(path) == 1 and top in _BATCH_KEYS:
        return True
    disabled = isinstance(raw.get(top), dict) and not _enabled(raw[top])
    if top in _NO_EFFECT_TOP or disabled:
        return True
    if top == "zero_optimization" and len(path) >= 2:
        key = path[1]
        offload_knob = key.startswith("offload_") and len(path) == 3 and path[2] not in ("device", "ratio")
        return key in _SIZES or key in _NO_EFFECT_ZERO or offload_knob
    return False


def _given(key, value, default=None):
    """value, which must not be "auto" (the Hugging Face integration fills
    those in; zerocore cannot tell what they should be)."""
    if value == "auto":
        raise DeepSpeedConfigError(f"zerocore: the DeepSpeed config key {key} is \"auto\", which zerocore cannot "
                                   "resolve; give its value")
    return default if value is None else value
