"""The bridge between the user's optimizer and the engine: what
zerocore.wrap accepts, and what it hands back.

wrap() reads the user's optimizer (torch.optim.Adam, AdamW, SGD, or
zerocore's own, ops/optim.py) into an OptimizerSpec: the kind and each param
group's hyperparameters. It then takes the optimizer over (drive_engine):
the same object, with the same param_groups, which the engine reads its
hyperparameters from at every step (so torch.optim.lr_scheduler works on
it), and whose step() and zero_grad() are the engine's: the user's habits
with the optimizer they hold drive the engine.
"""
from __future__ import annotations

import dataclasses
import types
import weakref

import torch

from zerocore.ops.optim import NativeOptimizer

# Hyperparameters each kind reads from a param group, and options whose
# non-default values zerocore does not implement.
_HYPER = {"adam": ("lr", "betas", "eps", "weight_decay"), "adamw": ("lr", "betas", "eps", "weight_decay"),
          "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov")}
_UNSUPPORTED = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}


@dataclasses.dataclass
class OptimizerSpec:
    kind: str
    param_groups: list  # dicts: "params" (list of Parameters) and the hyperparameters


def _kind_of(optimizer) -> str:
    if isinstance(optimizer, NativeOptimizer):
        return optimizer.kind
    if isinstance(optimizer, torch.optim.AdamW):
        return "adamw"
    if isinstance(optimizer, torch.optim.Adam):
        decoupled = any(g.get("decoupled_weight_decay", False) for g in optimizer.param_groups)
        return "adamw" if decoupled else "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    raise TypeError(f"zerocore.wrap: optimizer {type(optimizer).__name__} is not supported; use torch.optim.Adam, "
                    "AdamW or SGD (or zerocore.Adam/AdamW/SGD)")


def state_names(spec) -> tuple:
    """The fp32 optimizer-state arrays each partition needs."""
    if spec.kind == "sgd":
        return ("momentum_buffer",) if any(g["momentum"] for g in spec.param_groups) else ()
    return ("exp_avg", "exp_avg_sq")


def read_optimizer(optimizer) -> OptimizerSpec:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"zerocore.wrap: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    driver = getattr(optimizer, "_zerocore", None)
    if driver is not None and driver.live:
        raise ValueError("zerocore.wrap: this optimizer already drives an engine; close that engine first "
                         "(engine.close()), or give each wrapped model an optimizer of its own")
    kind = _kind_of(optimizer)
    groups = []
    for i, g in enumerate(optimizer.param_groups):
        for key, default in _UNSUPPORTED.items():
            if g.get(key, default) != default:
                raise ValueError(f"zerocore.wrap: {type(optimizer).__name__} param group {i} sets {key}="
                                 f"{g[key]!r}, which zerocore does not implement")
        if any(not isinstance(v, (int, float)) for k, v in g.items() if k in ("lr", "eps", "weight_decay")):
            raise ValueError(f"zerocore.wrap: param group {i} has a tensor hyperparameter; use Python floats")
        groups.append({"params": list(g["params"]), **{k: g[k] for k in _HYPER[kind]}})
    return OptimizerSpec(kind, groups)


class _Driver:
    """What a wrapped model's optimizer calls instead of its own step and
    zero_grad: the engine's, held weakly (the optimizer must not keep a
    dropped engine's buffers alive)."""

    def __init__(self, step, zero_grad):
        self._step, self._zero_grad = weakref.WeakMethod(step), weakref.WeakMethod(zero_grad)
        self.closed = False

    @property
    def live(self) -> bool:
        return not self.closed and self._step() is not None

    def _engine(self, method):
        fn = method()
        if self.closed or fn is None:
            raise RuntimeError("zerocore: this optimizer's engine was closed (engine.close()) or dropped; wrap the "
                               "module again (zerocore.wrap(model, optimizer, ...)) to go on training")
        return fn

    def step(self):
        return self._engine(self._step)()

    def zero_grad(self):
        self._engine(self._zero_grad)()


def _step(self, closure=None):
    """The engine's step (zerocore.wrap took this optimizer over): returns
    False when an fp16 overflow skipped it."""
    if closure is not None:
        raise ValueError("zerocore: step(closure) is not supported; call engine.backward(loss), then step()")
    self._opt_called = True  # what lr schedulers' own wrapper of step() records
    return self._zerocore.step()


# Schedulers wrap optimizer.step to record that it ran; this one records it
# itself, so a scheduler made before or after wrap neither wraps nor warns.
_step._wrapped_by_lr_sched = True


def _zero_grad(self, set_to_none: bool = True):
    """The engine's zero_grad: its grads are zeroed and every .grad is None."""
    self._zerocore.zero_grad()


def _state_dict(self):
    """Not supported: torch's form would be silently empty, losing every
    moment, the step count and the loss scale."""
    raise NotImplementedError(
        "zerocore: optimizer.state_dict() cannot save a wrapped model's optimizer: its state (Adam moments, fp32 "
        "master weights, step count, loss scale) lives partitioned across ranks in the engine's native buffers, "
        "and torch's state_dict would be empty. Save it with engine.save(path) on every rank (and "
        "engine.load(path) to resume, at any world size and stage).")


def _load_state_dict(self, state_dict):
    raise NotImplementedError(
        "zerocore: optimizer.load_state_dict() cannot restore a wrapped model's optimizer: its state lives in the "
        "engine's native buffers. Resume with engine.load(path), from a checkpoint engine.save(path) wrote.")


def _add_param_group(self, param_group):
    raise ValueError("zerocore: add_param_group() on a wrapped model's optimizer: the engine lays out and "
                     "partitions the params it trains when it wraps the model. Give the optimizer every param "
                     "group before zerocore.wrap.")


_DRIVEN = {"step": _step, "zero_grad": _zero_grad, "state_dict": _state_dict,
           "load_state_dict": _load_state_dict, "add_param_group": _add_param_group}


def drive_engine(optimizer, engine_step, engine_zero_grad):
    """Makes the user's optimizer drive the engine: its step() and
    zero_grad() become the engine's, and its param_groups stay the ones the
    engine reads its hyperparameters from at every step, so an lr scheduler
    on it, made before or after wrap, applies. Its own state stays empty;
    state_dict() and load_state_dict() raise and point at engine.save and
    engine.load."""
    optimizer._zerocore = _Driver(engine_step, engine_zero_grad)
    for name, fn in _DRIVEN.items():
        setattr(optimizer, name, types.MethodType(fn, optimizer))


def release(optimizer):
    """Its engine was closed: step() and zero_grad() refuse from now on
    (until it is wrapped again)."""
    optimizer._zerocore.closed = True
