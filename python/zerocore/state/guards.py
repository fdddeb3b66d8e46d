"""What a user's habits reach of the params and grads the engine keeps in
its own buffers, guarded so that none of it is silently wrong.

- A released stage-3 param (its unit not gathered) has its full shape but
  no values: its .data is a placeholder that reads as NaN everywhere (one
  element repeated by zero strides). While released, the param's class is
  a subclass of its own (ReleasedParam) whose in-place writes raise, and so
  do writes through its .data: such a write could never reach the shards,
  so `weight.fill_(1.0)` or `nn.init.normal_(weight)` would otherwise
  vanish without a word. So does rebinding its .data (`p.data = t`), for
  the same reason; where params are held whole, a rebinding reaches the
  engine as an in-place write would (ParamBinder.take_rebound). Reads pass
  (counting params, shapes, dtypes).
  Binding the param to a gathered buffer gives it its own class back, so
  none of this runs in forward or backward.
- model.state_dict() and model.load_state_dict() on a module with released
  params raise on the calling rank (guard_module_state): gathering the
  values would be a collective, which hangs when only rank 0 calls it.
- After engine.backward, a param's .grad is a placeholder (GradPlaceholder)
  that raises on use: the grads live in the engine's buffers, reduced
  across ranks only at the step (stages 0-1) or partitioned over them
  (stages 2-3), so torch.nn.utils.clip_grad_norm_ or a logged grad norm
  would read a local, unreduced grad, or none at all.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_leaves

# Methods whose names end in "_" but that change no values.
_METADATA_METHODS = {"requires_grad_", "retain_grad", "share_memory_"}


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


def _writes(func, kwargs) -> bool:
    """Whether a torch function call writes into its first argument (or
    into a tensor given as out=); property setters (.data=, .grad=) rebind
    rather than write."""
    name = _name(func)
    if name in _METADATA_METHODS or name == "__set__":
        return False
    in_place = (name.endswith("_") and not name.startswith("__")) or name.startswith("__i") or name == "__setitem__"
    return in_place or (kwargs or {}).get("out") is not None


def _is_data_getter(func) -> bool:
    return _name(func) == "__get__" and getattr(func, "__self__", None) is torch.Tensor.data


def same_binding(a, b) -> bool:
    """Whether tensors a and b are the same elements of the same memory."""
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)


def _rebinds_data(func, args) -> bool:
    """Whether a call sets its first argument's .data to other memory, a
    shape or a dtype; setting it to what it is (`p.data = p.data`, or the
    `param.data = param.to(...)` of module.to() when that changes nothing)
    changes nothing."""
    is_setter = _name(func) == "__set__" and getattr(func, "__self__", None) is torch.Tensor.data
    return is_setter and not same_binding(args[0], args[1])


def _written(args, kwargs):
    """The tensor a call writes into, if it writes: its first argument,
    given by position or, as torch.nn.init's functions take it, by name."""
    if args:
        return args[0]
    return next((v for v in (kwargs or {}).values() if isinstance(v, torch.Tensor)), None)


def _plain(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **(kwargs or {}))


def _write_error(what: str) -> RuntimeError:
    return RuntimeError(
        f"zerocore: {what}, a stage-3 param that is released: this rank holds only its shard, "
        "so the write could not reach the training state and would be lost. Edit params inside `with "
        "engine.gathered_params():` on every rank (edits go to the shards), or set them with "
        "engine.load_state_dict(...) on every rank.")


def dtype_changed(name: str, cast: torch.dtype, planned: torch.dtype) -> RuntimeError:
    """A param cast after wrap (model.to(dtype), .half(), .bfloat16()):
    refused, the params as they were (at stage 3 the cast raises; at stages
    0-2 the next forward undoes it: ParamBinder.undo_casts)."""
    return RuntimeError(
        f"zerocore: {name} was cast to {cast} after zerocore.wrap (model.to(dtype), .half(), .bfloat16()?), but "
        f"the engine laid the params out, and trains them, in {planned}, in buffers of its own: the cast is "
        "refused and the params are as they were. To train in 16 bits, ask the engine: model = engine.close() "
        "(the params as trained), then zerocore.wrap(model, opt, Config(dtype='bf16')) (or 'fp16': 16-bit "
        "compute with fp32 master weights; the engine casts the inputs).")


class ReleasedParam(torch.nn.Parameter):
    """The class of a stage-3 param while it is released."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        target = _written(args, kwargs)
        if isinstance(target, ReleasedParam):
            if _writes(func, kwargs):
                raise _write_error(f"{_name(func)} on {target._zerocore_name}")
            if _rebinds_data(func, args):
                if args[1].dtype != args[0].dtype:
                    raise dtype_changed(target._zerocore_name, args[1].dtype, args[0].dtype)
                raise _write_error(f"setting the .data of {target._zerocore_name}")
            if _is_data_getter(func):  # p.data.fill_(...) must raise as p.fill_(...) does
                return _ReleasedData.of(_plain(func, args, kwargs), target._zerocore_name)
        return _plain(func, args, kwargs)


class _ReleasedData(torch.Tensor):
    """The .data of a released param: writes raise."""

    @staticmethod
    def of(data, name):
        out = data.as_subclass(_ReleasedData)
        out._zerocore_name = name
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        target = _written(args, kwargs)
        if isinstance(target, _ReleasedData) and _writes(func, kwargs):
            raise _write_error(f"{_name(func)} on {target._zerocore_name}")
        return _plain(func, args, kwargs)


_released_classes = {torch.nn.Parameter: ReleasedParam}


def _released_class(cls):
    """ReleasedParam, or for a user's own Parameter subclass a subclass of both."""
    if cls not in _released_classes:
        _released_classes[cls] = type(f"Released{cls.__name__}", (ReleasedParam, cls), {})
    return _released_classes[cls]


def release(p, placeholder, name: str):
    """p points at `placeholder` and refuses writes until restore(p)."""
    if not isinstance(p, ReleasedParam):
        p._zerocore_class = type(p)
        p._zerocore_name = name
        p.__class__ = _released_class(type(p))
    with torch._C.DisableTorchFunctionSubclass():  # the engine's own rebinding, which the guard refuses users
        p.data = placeholder


def restore(p, data):
    """p has its own class again, and `data`."""
    if isinstance(p, ReleasedParam):
        p.__class__ = p._zerocore_class
    p.data = data


def is_released(p) -> bool:
    return isinstance(p, ReleasedParam)


@contextlib.contextmanager
def unguarded(params):
    """In the block the params take writes, released or not (wrap's
    initialisation writes their values into temporaries it then carries to
    the shards); after it, the released ones refuse them again."""
    released = [p for p in params if is_released(p)]
    for p in released:
        p.__class__ = p._zerocore_class
    try:
        yield
    finally:
        for p in released:
            p.__class__ = _released_class(p.__class__)


# Module state --------------------------------------------------------------
_engine_reading = False


def state_dict_keys(module) -> list:
    """The keys of module.state_dict(), in its order, past the guards: the
    engine's own view of the module."""
    global _engine_reading
    _engine_reading = True
    try:
        return list(module.state_dict(keep_vars=True))
    finally:
        _engine_reading = False


def _released_names(module) -> list:
    return [p._zerocore_name for p in module.parameters() if is_released(p)]


def _refuse_state_dict(module, prefix, keep_vars):
    released = [] if _engine_reading else _released_names(module)
    if released:
        raise RuntimeError(
            f"zerocore: state_dict() of a stage-3 model whose params are sharded across ranks ({released[0]} and "
            f"{len(released) - 1} more are released: this rank holds only its shard). Call "
            "engine.full_state_dict() on every rank for the full params (then save on rank 0), engine.save(path) "
            "on every rank for a checkpoint, or call state_dict() inside `with engine.gathered_params():` on every "
            "rank.")


def _refuse_load_state_dict(module, state_dict, prefix, *args):
    released = _released_names(module)
    if released:
        raise RuntimeError(
            f"zerocore: load_state_dict() into a stage-3 model whose params are sharded across ranks ({released[0]} "
            f"and {len(released) - 1} more are released): the values could not reach the shards. Call "
            "engine.load_state_dict(state_dict) on every rank, or engine.load(path) for a checkpoint that "
            "engine.save wrote.")


def guard_module_state(module, sharded) -> list:
    """Hooks on every module holding params in `sharded` (ids) in its
    subtree, so that state_dict() and load_state_dict() called on it, or
    on the root, refuse while any of them is released; returns their
    handles. The hooks run before anything is read or written: a refused
    load changes nothing."""
    handles = []
    if not sharded:
        return handles
    for m in module.modules():
        if any(id(p) in sharded for p in m.parameters()):
            handles.append(m.register_state_dict_pre_hook(_refuse_state_dict))
            handles.append(m.register_load_state_dict_pre_hook(_refuse_load_state_dict))
    return handles


# Grads ---------------------------------------------------------------------
# Reads of a grad placeholder that say nothing about its values.
_METADATA_READS = {"size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point"}


class GradPlaceholder(torch.Tensor):
    """A param's .grad after engine.backward: raises on use (see the module
    docstring); shape, dtype and device read as the param's."""

    @staticmethod
    def of(p, stage: int, name: str):
        base = torch.full((1,), float("nan"), dtype=p.dtype, device=p.device)
        out = base.expand(p.shape).as_subclass(GradPlaceholder)
        out._zerocore_where = (stage, name)
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = _name(func)
        if name in _METADATA_READS or (name == "__get__" and not _is_data_getter(func)):
            return _plain(func, args, kwargs)
        # The first placeholder among the arguments (lists of them too: torch._foreach_norm).
        holder = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, GradPlaceholder))
        stage, param = holder._zerocore_where
        where = "reduced across ranks only at engine.step()" if stage < 2 else \
            "reduced into partitions, each rank holding its own part"
        raise RuntimeError(
            f"zerocore: {name} on {param}.grad: at stage {stage} the engine keeps the grads in its own buffers, "
            f"{where}, so the param's .grad holds no values. For the global grad norm, or to clip by it, call "
            "engine.clip_grad_norm_(max_norm) on every rank between engine.backward() and engine.step() (it "
            "returns the norm, as torch.nn.utils.clip_grad_norm_ does), or set Config(max_grad_norm=...).")
