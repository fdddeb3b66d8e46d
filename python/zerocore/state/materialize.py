"""Params that get their values at wrap, on each rank only the part it holds:
a model built on the meta device (zerocore.init()), initialised or loaded
into the flat groups without ever existing whole on one rank.

wrap swaps each meta param in place (the same Parameter object, which the
optimizer holds) for a param of its shape whose storage holds no memory,
on the device training runs on (wrap's device=, the CPU by default), and
each meta buffer for a zeroed one there; it builds the flat groups
without values for those params (FlatGroup's values_later: zeros, no
broadcast from rank 0) and then fills them on every rank alike, each rank
writing only what it holds (FlatGroup.load_param: the full params in stages
0-2, the shard in stage 3, and the fp32 master), from one of:

- init=None: each module's reset_parameters() (nn.MultiheadAttention's
  _reset_parameters(), which zeroes its out_proj's bias too), replayed as
  eager construction runs it (below): the values, and the global RNG after
  wrap, are those of building the model on the CPU after the same
  torch.manual_seed;
- init=fn: fn(module) on each module that holds meta params or buffers of
  its own, children first, as model.apply(fn) calls it (init=model._init_weights);
- init=a state_dict, or the path of a safetensors file: each param straight
  from it (a file is mapped, so only the stretches this rank holds are
  read). engine.load_state_dict loads the same sources into a wrapped engine.

The replay walks the modules children first, each module once, the order in
which a model built from standard layers runs their reset_parameters while
it is constructed. A module initialises its own (direct) params on
temporary full-size CPU tensors of their original dtype, whose values go to
the groups before the next module runs: beyond the engine's own memory, the
replay holds one module's params at a time, the large ones in native arenas
that go back to the OS as each module is done (_scratch), so that wrap leaves
no freed heap behind. A module's params that held
values keep them (a throwaway tensor takes the module's initialisation).

Tied params (one Parameter registered by several modules). Eager
construction initialises each module's own param and then ties them; in the
usual form, `self.head.weight = self.embed.weight`, the param of the module
built first survives with its values, and the later module's initialisation
is dropped. The replay gives a tied param the values of the first module in
the walk that registers it; later ones still run their reset_parameters, on
a throwaway tensor, so that the RNG advances as it did. init=fn follows
model.apply instead, where every module's call writes the one tied tensor,
so the last module's values stay.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

import zerocore
from zerocore import param_guards
from zerocore.flat_group import NATIVE_NAMES
from zerocore.io.safetensors_file import Reader

_MALLOC_MMAP_THRESHOLD = 128 << 10  # glibc's initial M_MMAP_THRESHOLD


def init():
    """A context in which modules are built on the meta device: they hold no
    memory, and zerocore.wrap gives them their values, each rank only its
    part (see wrap's init=). The same as `with torch.device("meta"):`."""
    return torch.device("meta")


class IncompatibleKeys(NamedTuple):
    """What engine.load_state_dict(strict=False) left out, as torch's
    Module.load_state_dict reports it."""

    missing_keys: list
    unexpected_keys: list


def _listing(names) -> str:
    names = list(names)
    return ", ".join(names[:5]) + (f" ... ({len(names)} in all)" if len(names) > 5 else "")


def _reads(t: torch.Tensor):
    """read(first, n): elements first..first+n-1 of t, flattened (what
    FlatGroup.load_param asks for)."""
    flat = t.reshape(-1)
    return lambda first, n: flat[first:first + n]


def _no_memory(shape, dtype, device) -> torch.Tensor:
    """A tensor on `device` of `shape` whose storage holds no memory: a
    param's stand-in until its flat group binds it."""
    t = torch.empty((), dtype=dtype, device=device).expand(shape)
    t.untyped_storage().resize_(0)
    return t


def _scratch(shape, dtype) -> torch.Tensor:
    """A CPU tensor that one module's params are initialised on during the
    replay (its values are all overwritten or dropped). A large one (at least glibc's initial mmap
    threshold, 128 KiB) lives in a native arena of its own, whose pages go
    back to the OS when it is dropped: from glibc's malloc it would be
    mapped too, but freeing it raises the mmap threshold to its size, and
    the next module's block of that size then comes from a heap that glibc
    keeps resident after wrap (bench/RESULTS.md has the peak RSS it
    costs). Small ones come from the heap either way."""
    if dtype in NATIVE_NAMES and math.prod(shape) * dtype.itemsize >= _MALLOC_MMAP_THRESHOLD:
        return zerocore.to_torch(zerocore.zeros([math.prod(shape)], NATIVE_NAMES[dtype])).view(shape)
    return torch.empty(shape, dtype=dtype)


def _post_order(module):
    """(path, module) of every module, children before their parent, each once."""
    paths = {id(m): name for name, m in module.named_modules()}
    seen, out = set(), []

    def visit(m):
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        out.append((paths[id(m)], m))

    visit(module)
    return out


def _reset(module):
    """The method that initialises `module` as its constructor does:
    reset_parameters(), or nn.MultiheadAttention's _reset_parameters(), or None."""
    for name in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, name, None)
        if callable(method):
            return method
    return None


def _module_label(path, module) -> str:
    return f"{path or 'the root module'} ({type(module).__name__})"


def _buffers(module) -> dict:
    """name -> (buffer, persistent) of every buffer the module holds."""
    out = {}
    for prefix, mod in module.named_modules():
        for name, b in mod._buffers.items():
            if b is not None:
                out[f"{prefix}.{name}" if prefix else name] = (b, name not in mod._non_persistent_buffers_set)
    return out


class Source:
    """Tensors by name from a state_dict or a safetensors file: the shapes
    known at once, the elements read when loaded."""

    def __init__(self, source):
        if isinstance(source, (str, os.PathLike)):
            self._file = Reader(source)
            self.shapes = {name: shape for name, (_, shape, _) in self._file.entries.items()}
            self._get = self._file.get
        elif isinstance(source, Mapping):
            self._file = None
            # None: a value that is not a tensor.
            self.shapes = {k: v.shape if isinstance(v, torch.Tensor) else None for k, v in source.items()}
            self._get = source.__getitem__
        else:
            raise TypeError("expected a state_dict (a mapping of names to tensors) or the path of a .safetensors "
                            f"file, got {type(source).__name__}")

    def get(self, name) -> torch.Tensor:
        return self._get(name).detach()

    def reader(self, name):
        """Tensor `name` for FlatGroup.load_param; a file's elements are read
        from disk only as they are asked for."""
        return _reads(self.get(name))

    def close(self):
        if self._file is not None:
            self._file.close()


class Loader:
    """Sets a module's params and buffers from a Source: each param from the
    first of its names the source holds (a tied param has several), each
    buffer from its name. Everything is checked when it is made, before
    anything is set: `problem` is the error, or None."""

    def __init__(self, source, module, params, names, *, where: str, what: str, strict: bool):
        self.module = module
        self.problem = None
        self.param_keys, self.buffer_keys = {}, {}
        self.missing, self.unexpected = [], []
        try:
            self.source = Source(source)
        except (OSError, ValueError, TypeError) as e:
            self.problem = ValueError(f"{where}: cannot read {what}: {e}")
            return
        wrong = self._match(params, names)
        self.problem = self._fit_problem(f"{where}: {what}", strict, wrong)

    def _match(self, params, names) -> list:
        """Fills the keys to load, missing and unexpected; returns the keys
        whose tensors do not fit."""
        shapes = self.source.shapes
        known, wrong = set(), []

        def fits(key, target) -> bool:
            known.add(key)
            if shapes[key] is None:
                wrong.append(f"{key} (not a tensor)")
            elif tuple(shapes[key]) != tuple(target.shape):
                wrong.append(f"{key} ({tuple(shapes[key])} in the source, {tuple(target.shape)} in the model)")
            else:
                return True
            return False

        for p in params:
            held = [n for n in names[id(p)] if n in shapes]
            known.update(names[id(p)])
            if not held:
                self.missing.append(names[id(p)][0])
            elif fits(held[0], p):
                self.param_keys[id(p)] = held[0]
        for name, (b, persistent) in _buffers(self.module).items():
            known.add(name)
            if name in shapes:
                if fits(name, b):
                    self.buffer_keys[name] = name
            elif persistent or b.is_meta:  # a meta buffer has no value to keep
                self.missing.append(name)
        self.unexpected = [k for k in shapes if k not in known]
        return wrong

    def _fit_problem(self, subject, strict, wrong):
        parts = [f"shapes differ: {_listing(wrong)}"] if wrong else []
        if strict and self.missing:
            parts.append(f"missing: {_listing(self.missing)}")
        if strict and self.unexpected:
            parts.append(f"unexpected: {_listing(self.unexpected)}")
        if not parts:
            return None
        return ValueError(f"{subject} does not fit the model ({'; '.join(parts)}); it must hold each "
                          "param of the module (a tied param under any of its names) and each persistent buffer, "
                          "in the module's shape, and nothing else")

    def load(self, places):
        """places: id(param) -> (its FlatGroup, its index there)."""
        with torch.no_grad():
            for pid, key in self.param_keys.items():
                group, index = places[pid]
                group.load_param(index, self.source.reader(key))
            for name, key in self.buffer_keys.items():
                self.module.get_buffer(name).copy_(self.source.get(key))
        self.source.close()


class Initializer:
    """How wrap gives the params their values when some are on the meta
    device, or when init= names where the values come from (see the module
    docstring). Made before the ranks compare models (`problem`: this
    rank's error, or None); materialize() before the groups are built;
    fill(places) once they are."""

    def __init__(self, module, params, names, init):
        self.module = module
        self.meta = {id(p): p.dtype for p in params if p.is_meta}  # the dtype each is initialised in
        self.fn = None
        self.loader = None
        self.problem = None
        # Modules with meta params or buffers of their own, in replay order.
        self.replayed = [(path, m) for path, m in _post_order(module)
                         if any(t.is_meta for t in (*m._parameters.values(), *m._buffers.values()) if t is not None)]
        if init is None:
            self.kind = "reset_parameters" if self.replayed else None
            self.problem = self._reset_problem()
        elif isinstance(init, (str, os.PathLike, Mapping)):
            self.kind = "source"
            self.loader = Loader(init, module, params, names, where="zerocore.wrap", what="init=", strict=True)
            self.problem = self.loader.problem
        elif callable(init):
            self.kind, self.fn = "function", init
            if not self.replayed:
                self.problem = ValueError(
                    "zerocore.wrap: init= is a function, but no parameter or buffer is on the meta device, so it "
                    "has nothing to initialise; build the model inside zerocore.init(), or call model.apply(init) "
                    "before wrap")
        else:
            self.kind = None
            self.problem = TypeError(
                "zerocore.wrap: init= takes None (each module's reset_parameters), a function called on each "
                "module as model.apply(fn) does, a state_dict, or the path of a .safetensors file; got "
                f"{type(init).__name__}")

    def _reset_problem(self):
        bare = [_module_label(path, m) for path, m in self.replayed if _reset(m) is None]
        if not bare:
            return None
        return ValueError(
            f"zerocore.wrap: module(s) {_listing(bare)} hold parameters or buffers on the meta device but have no "
            "reset_parameters() to initialise them; pass init=fn, a function that initialises one module's own "
            "params and buffers in place (called on each module, as model.apply(fn)), such as "
            "init=model._init_weights, or init= a state_dict or a .safetensors path to load them from")

    @property
    def uses_rng(self) -> bool:
        """Whether every rank draws the values from its own RNG."""
        return self.kind in ("reset_parameters", "function")

    @property
    def values_later(self) -> set:
        """ids of the params the groups get no values for at first: fill gives them."""
        if self.kind == "source":
            return set(self.loader.param_keys)
        return set(self.meta)

    def materialize(self, device: torch.device):
        """Meta params become params on `device` (where training runs) of
        their shape with no memory (the groups bind them), the same objects;
        meta buffers become zeros there."""
        for p in self.module.parameters():
            if id(p) in self.meta:
                torch.utils.swap_tensors(p, nn.Parameter(_no_memory(p.shape, p.dtype, device),
                                                         requires_grad=p.requires_grad))
        zeros = {}
        for mod in self.module.modules():
            for name, b in mod._buffers.items():
                if b is not None and b.is_meta:
                    if id(b) not in zeros:
                        zeros[id(b)] = torch.zeros(b.shape, dtype=b.dtype, device=device)
                    mod._buffers[name] = zeros[id(b)]

    def fill(self, places):
        """Gives the params in values_later (and the meta buffers) their
        values. places: id(param) -> (its FlatGroup, its index there)."""
        if self.kind == "source":
            self.loader.load(places)
        elif self.uses_rng:
            self._replay(places)

    def _replay(self, places):
        """Each module in `replayed` initialises its own params on temporary
        tensors, which go to the groups; then the params are bound back.
        Released stage-3 params take these writes (unguarded)."""
        taken = set()  # params that have their values (reset_parameters: the first registrant's)
        for path, mod in self.replayed:
            direct = list(mod.named_parameters(recurse=False))
            # nn.MultiheadAttention's initialisation (_reset_parameters, run by
            # its constructor after its out_proj's) also zeroes out_proj.bias:
            # its children's params it writes take those values, as eagerly.
            owned = {id(p) for _, p in direct}
            nested = [] if self.fn or callable(getattr(mod, "reset_parameters", None)) else \
                [p for p in mod.parameters() if id(p) not in owned and id(p) in self.meta]
            with param_guards.unguarded([p for _, p in direct] + nested):
                bound = [p.data for _, p in direct]
                nested_bound = [p.data for p in nested]
                for p in [p for _, p in direct] + nested:
                    p.data = _scratch(p.shape, self.meta.get(id(p), p.dtype))
                versions = [p._version for p in nested]
                with torch.no_grad():
                    if self.fn:
                        self.fn(mod)
                    else:
                        _reset(mod)()
                for p, version in zip(nested, versions):
                    if p._version != version:  # written: the values of the module initialised last
                        group, index = places[id(p)]
                        group.load_param(index, _reads(p.data))
                for p, data in zip(nested, nested_bound):
                    p.data = data
                for name, p in direct:
                    if mod._parameters[name] is not p:
                        raise ValueError(
                            f"zerocore.wrap: initialising {_module_label(path, mod)} replaced its parameter {name} "
                            "with a new object; initialise params in place (nn.init.*, p.data.normal_()): the "
                            "engine and the optimizer hold the original")
                    if id(p) in self.meta and (self.fn or id(p) not in taken):
                        taken.add(id(p))
                        group, index = places[id(p)]
                        group.load_param(index, _reads(p.data))
                for (_, p), data in zip(direct, bound):
                    p.data = data
