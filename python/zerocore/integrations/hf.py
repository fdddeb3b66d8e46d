"""zerocore.integrations.hf: ZeRO for a Hugging Face Trainer, with one change.

    from zerocore.integrations.hf import ZeroTrainer
    trainer = ZeroTrainer(model=model, args=args, train_dataset=data, zero_config=zerocore.Config(stage=3))

ZeroTrainer is transformers.Trainer whose model a zerocore engine trains;
the TrainingArguments drive it as they drive the Trainer (batches, gradient
accumulation, max_grad_norm, bf16/fp16, the optimizer and lr scheduler,
logging, save_steps, resume_from_checkpoint). What it overrides, and why:

- _wrap_model: wraps the model with the Trainer's optimizer (zerocore.wrap)
  and hands the Trainer an EngineModule, whose forward is the engine's and
  whose zero_grad is the engine's. A model the Trainer gets back wrapped is
  not passed to accelerate's prepare, so accelerate never wraps it in DDP:
  the engine does the data parallelism. The data loader is still
  accelerate's, which gives each rank its own part of every global batch.
- The accelerator's backward and clip_grad_norm_, the only ways the Trainer
  reaches the grads, are the engine's. The Trainer scales each rank's loss
  for DDP, which sums grads over accumulation micro-batches and averages
  them over ranks, as engine.backward does: the scaling carries over as it
  is, and the global batch trains as the plain Trainer's would.
- _save: save_model writes the full fp32 params (engine.full_state_dict()
  on every rank; rank 0 writes them with save_pretrained, tied weights as
  Hugging Face stores them), which from_pretrained loads.
- _save_optimizer_and_scheduler, _load_optimizer_and_scheduler: a
  checkpoint-N folder holds engine.save's checkpoint (with the lr
  scheduler) in checkpoint-N/zerocore, beside the Trainer's own files;
  resume_from_checkpoint loads it with engine.load, params included, so
  _load_from_checkpoint has nothing left to do.

Launch the ranks with torchrun (or any launcher that sets RANK, WORLD_SIZE
and LOCAL_RANK): accelerate reads them, and on the CPU only with
TrainingArguments(use_cpu=True). zerocore trains on the CPU today.
"""
from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist
import transformers
from torch import nn

from zerocore.runtime import devices
from zerocore.config import Config
from zerocore.integrations.deepspeed.config import DeepSpeedConfig, fill_auto, read_json
from zerocore.engine import wrap

# The engine's checkpoint inside each of the Trainer's checkpoint-N folders.
CHECKPOINT_DIR = "zerocore"


class EngineModule(nn.Module):
    """The model as the Trainer trains and evaluates it: calls go through
    the engine (stage 3 gathers, the training dtype), zero_grad is the
    engine's. `module` is the model (train() and eval() reach it)."""

    def __init__(self, engine):
        super().__init__()
        self.module = engine.module
        self.engine = engine

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True):
        self.engine.zero_grad()

    def _get_name(self):
        return self.module._get_name()  # the Trainer picks a causal LM's label smoothing by the model's name


_BLOCKS = ("ZeroTrainer: the DeepSpeed config has an optimizer or scheduler block; the Trainer builds them from its "
           "arguments (optim, learning_rate, weight_decay, lr_scheduler_type, ...) or takes optimizers=(optimizer, "
           "scheduler): remove the blocks")


def _deepspeed_dict(zero_config):
    """zero_config as a DeepSpeed config (a path, or a dict with keys that
    are no Config fields), or None."""
    if isinstance(zero_config, (str, os.PathLike)):
        return read_json(zero_config)
    fields = {f.name for f in dataclasses.fields(Config)}
    if isinstance(zero_config, dict) and not set(zero_config) <= fields:
        return zero_config
    return None


def _filled(raw, args, model) -> dict:
    """raw with its "auto" values filled from the TrainingArguments and the
    model, as transformers' own DeepSpeed integration fills them
    (HfTrainerDeepSpeedConfig): the batch keys, gradient_clipping, the
    precision blocks, and the ZeRO sizes from the model's hidden_size (else
    zerocore's own)."""
    batch, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    values = {("train_micro_batch_size_per_gpu",): batch, ("gradient_accumulation_steps",): accum,
              ("train_batch_size",): batch * accum * args.world_size, ("gradient_clipping",): args.max_grad_norm,
              ("fp16", "enabled"): bool(args.fp16 or args.fp16_full_eval),
              ("bf16", "enabled"): bool(args.bf16 or args.bf16_full_eval)}
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(hidden, int):
        values.update({("zero_optimization", "reduce_bucket_size"): hidden * hidden,
                       ("zero_optimization", "stage3_prefetch_bucket_size"): int(0.9 * hidden * hidden),
                       ("zero_optimization", "stage3_param_persistence_threshold"): 10 * hidden})
    return fill_auto(raw, values)


def _resolve_config(zero_config, args, model) -> Config:
    """The engine's Config: zero_config's (a Config, a dict of its fields,
    or a DeepSpeed config's ZeRO part: a zerocore.DeepSpeedConfig, its path
    or its dict, whose "auto" values the TrainingArguments fill), in the
    dtype args.bf16 or args.fp16 asks for."""
    raw = _deepspeed_dict(zero_config)
    if raw is not None:
        if raw.get("optimizer") is not None or raw.get("scheduler") is not None:
            raise ValueError(_BLOCKS)
        zero_config = DeepSpeedConfig(_filled(raw, args, model), world_size=args.world_size)
    deepspeed = isinstance(zero_config, DeepSpeedConfig)
    if deepspeed:
        _check_deepspeed(zero_config, args)
        zero_config = zero_config.config
    config = Config.from_any(zero_config)
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    if dtype is None or config.dtype == dtype:
        return config
    if deepspeed or config.dtype != "fp32":
        raise ValueError(f"ZeroTrainer: the TrainingArguments ask for {dtype} but zero_config for {config.dtype}; "
                         "ask for one training dtype" + (f" (the DeepSpeed config's {dtype} block sets it there, "
                                                         "and the sizes it gives in elements)" if deepspeed else ""))
    same = config.reduce_dtype == config.dtype  # reductions in the training dtype, as Config's default
    return dataclasses.replace(config, dtype=dtype, reduce_dtype=dtype if same else config.reduce_dtype)


def _check_deepspeed(ds, args):
    """The Trainer's arguments give the batches, the optimizer and the
    scheduler: a DeepSpeed config may not say otherwise."""
    if ds._optimizer_block is not None or ds._scheduler_block is not None:
        raise ValueError(_BLOCKS)
    given = {"train_micro_batch_size_per_gpu": (ds.micro_batch_size, args.per_device_train_batch_size),
             "gradient_accumulation_steps": (ds.gradient_accumulation_steps, args.gradient_accumulation_steps)}
    for key, (theirs, ours) in given.items():
        if theirs != ours:
            raise ValueError(f"ZeroTrainer: the DeepSpeed config's {key} is {theirs} but the TrainingArguments give "
                             f"{ours}; the Trainer's arguments drive the batches: make them agree")


def _check_args(args, model_init):
    """What ZeroTrainer cannot do as the Trainer would, refused up front."""
    if args.device.type not in devices.SUPPORTED:
        raise ValueError(f"ZeroTrainer: the Trainer's device is {args.device}, but zerocore trains on "
                         f"{' and '.join(devices.SUPPORTED)} devices only: pass TrainingArguments(use_cpu=True)")
    launched = dist.get_world_size() if dist.is_available() and dist.is_initialized() \
        else int(os.environ.get("WORLD_SIZE", "1"))
    if args.world_size != launched:
        raise ValueError(f"ZeroTrainer: {launched} processes were launched but the Trainer sees {args.world_size}, "
                         "so it would not give each rank its own part of the data. accelerate takes the ranks from "
                         "the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, as torchrun sets them), and on "
                         "the CPU only with TrainingArguments(use_cpu=True)")
    refused = {"deepspeed": "zerocore partitions the model itself: drop deepspeed= (pass a DeepSpeed config as "
                            "zero_config=zerocore.DeepSpeedConfig(...))",
               "fsdp": "zerocore partitions the model itself: drop fsdp=",
               "torch_compile": "not supported by ZeroTrainer yet",
               "load_best_model_at_end": "not supported by ZeroTrainer yet; from_pretrained loads the model of any "
                                         "checkpoint-N folder",
               "auto_find_batch_size": "not supported by ZeroTrainer"}
    for name, why in refused.items():
        if getattr(args, name, None):
            raise ValueError(f"ZeroTrainer: TrainingArguments({name}=...): {why}")
    if model_init is not None:
        raise ValueError("ZeroTrainer: model_init (a new model per trial) is not supported; pass model=")


class ZeroTrainer(transformers.Trainer):
    """transformers.Trainer training its model with ZeRO (the module
    docstring says how). zero_config: a zerocore.Config (default:
    Config(), stage 3), a dict of its fields, or a DeepSpeed config: a
    zerocore.DeepSpeedConfig, the path of its JSON or its dict (its ZeRO,
    precision and clipping keys, each "auto" filled from the
    TrainingArguments as the Trainer's DeepSpeed integration fills them;
    the TrainingArguments give the batches, the optimizer and the
    scheduler). args.bf16 / args.fp16 set
    the training dtype. trainer.engine is the engine once training starts
    (None before); between steps, read the model's params inside `with
    trainer.engine.gathered_params():` on every rank, or save it with
    trainer.save_model() on every rank."""

    def __init__(self, *args, zero_config=None, **kwargs):
        self.engine = None
        self._engine_module = None
        super().__init__(*args, **kwargs)
        _check_args(self.args, self.model_init)
        self.zero_config = _resolve_config(zero_config, self.args, self.model)

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        # The Trainer reaches the grads only through these two.
        self.accelerator.backward = self._engine_backward
        self.accelerator.clip_grad_norm_ = self._engine_clip_grad_norm_

    def _engine_backward(self, loss, **kwargs):
        self.engine.backward(loss / self.accelerator.gradient_accumulation_steps)  # as accelerate divides

    def _engine_clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        return self.engine.clip_grad_norm_(max_norm, norm_type)

    def _wrap_model(self, model, training=True, dataloader=None):
        if self.engine is None and training:
            self._start_engine()
        if self.engine is None:  # evaluating before training: the plain model
            return super()._wrap_model(model, training, dataloader)
        return self._engine_module

    def _start_engine(self):
        optimizer = self.optimizer
        self.engine = wrap(self.model, optimizer, self.zero_config)
        # The Trainer hands the optimizer to accelerate once it has the model:
        # prepared here, without the round trip through its (now refused)
        # state_dict, it is left as it is then.
        self.optimizer = accelerated = self.accelerator.prepare(optimizer, device_placement=[False])
        engine_step = optimizer.step

        def step(closure=None):  # an fp16 overflow skips the step, and so the Trainer's scheduler step
            applied = engine_step(closure)
            accelerated._is_overflow = applied is False
            return applied

        step._wrapped_by_lr_sched = True  # as the engine's step it calls (optim.py): schedulers need not wrap it
        optimizer.step = step
        self._engine_module = EngineModule(self.engine)

    # Checkpoints -----------------------------------------------------------------
    def _save(self, output_dir=None, state_dict=None):
        if state_dict is None and self.engine is not None:
            state_dict = self.engine.full_state_dict()  # every rank takes part; rank 0 writes
        super()._save(output_dir, state_dict)

    def _save_optimizer_and_scheduler(self, output_dir):
        self.engine.save(os.path.join(output_dir, CHECKPOINT_DIR), lr_scheduler=self.lr_scheduler)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        pass  # engine.load restores the params with the optimizer (_load_optimizer_and_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is not None:
            self.engine.load(os.path.join(checkpoint, CHECKPOINT_DIR), lr_scheduler=self.lr_scheduler)
