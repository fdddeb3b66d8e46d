"""Params that get their values at wrap, on each rank only the part it holds:
a model built on the meta device (zerocore.init()), initialised into the
flat groups without ever existing whole on one rank.

wrap swaps each meta param in place (the same Parameter object, which the
optimizer holds) for a CPU param of its shape whose storage holds no
memory, and each meta buffer for a zeroed CPU one; it builds the flat groups
without values for those params (FlatGroup's values_later: zeros, no
broadcast from rank 0) and then fills them on every rank alike, each rank
writing only what it holds (FlatGroup.load_param: the full params in stages
0-2, the shard in stage 3, and the fp32 master), by one of:

- init=None: each module's reset_parameters(), replayed as eager construction
  runs it (below): the values, and the global RNG after wrap, are those of
  building the model on the CPU after the same torch.manual_seed;
- init=fn: fn(module) on each module that holds meta params or buffers of
  its own, children first, as model.apply(fn) calls it (init=model._init_weights).

The replay walks the modules children first, each module once, the order in
which a model built from standard layers runs their reset_parameters while
it is constructed. A module initialises its own (direct) params on
temporary full-size CPU tensors of their original dtype, whose values go to
the groups before the next module runs: beyond the engine's own memory, the
replay holds one module's params at a time. A module's params that held
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

import torch
from torch import nn


def init():
    """A context in which modules are built on the meta device: they hold no
    memory, and zerocore.wrap gives them their values, each rank only its
    part (see wrap's init=). The same as `with torch.device("meta"):`."""
    return torch.device("meta")


def _listing(names) -> str:
    names = list(names)
    return ", ".join(names[:5]) + (f" ... ({len(names)} in all)" if len(names) > 5 else "")


def _reads(t: torch.Tensor):
    """read(first, n): elements first..first+n-1 of t, flattened (what
    FlatGroup.load_param asks for)."""
    flat = t.reshape(-1)
    return lambda first, n: flat[first:first + n]


def _no_memory(shape, dtype) -> torch.Tensor:
    """A CPU tensor of `shape` whose storage holds no memory: a param's
    stand-in until its flat group binds it."""
    t = torch.empty((), dtype=dtype).expand(shape)
    t.untyped_storage().resize_(0)
    return t


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


def _module_label(path, module) -> str:
    return f"{path or 'the root module'} ({type(module).__name__})"


class Initializer:
    """How wrap gives the params their values when some are on the meta
    device (see the module docstring). Made before the ranks compare models (`problem`: this
    rank's error, or None); materialize() before the groups are built;
    fill(places) once they are."""

    def __init__(self, module, params, init):
        self.module = module
        self.meta = {id(p): p.dtype for p in params if p.is_meta}  # the dtype each is initialised in
        self.fn = None
        self.problem = None
        # Modules with meta params or buffers of their own, in replay order.
        self.replayed = [(path, m) for path, m in _post_order(module)
                         if any(t.is_meta for t in (*m._parameters.values(), *m._buffers.values()) if t is not None)]
        if init is None:
            self.kind = "reset_parameters" if self.replayed else None
            self.problem = self._reset_problem()
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
                "zerocore.wrap: init= takes None (each module's reset_parameters) or a function called on each "
                f"module as model.apply(fn) does; got {type(init).__name__}")

    def _reset_problem(self):
        bare = [_module_label(path, m) for path, m in self.replayed
                if not callable(getattr(m, "reset_parameters", None))]
        if not bare:
            return None
        return ValueError(
            f"zerocore.wrap: module(s) {_listing(bare)} hold parameters or buffers on the meta device but have no "
            "reset_parameters() to initialise them; pass init=fn, a function that initialises one module's own "
            "params and buffers in place (called on each module, as model.apply(fn)), such as "
            "init=model._init_weights")

    @property
    def uses_rng(self) -> bool:
        """Whether every rank draws the values from its own RNG."""
        return self.kind in ("reset_parameters", "function")

    @property
    def values_later(self) -> set:
        """ids of the params the groups get no values for at first: fill gives them."""
        return set(self.meta)

    def materialize(self):
        """Meta params become CPU params of their shape with no memory (the
        groups bind them), the same objects; meta buffers become zeros."""
        for p in self.module.parameters():
            if id(p) in self.meta:
                torch.utils.swap_tensors(p, nn.Parameter(_no_memory(p.shape, p.dtype), requires_grad=p.requires_grad))
        zeros = {}
        for mod in self.module.modules():
            for name, b in mod._buffers.items():
                if b is not None and b.is_meta:
                    if id(b) not in zeros:
                        zeros[id(b)] = torch.zeros(b.shape, dtype=b.dtype)
                    mod._buffers[name] = zeros[id(b)]

    def fill(self, places):
        """Gives the params in values_later (and the meta buffers) their
        values. places: id(param) -> (its FlatGroup, its index there)."""
        if self.uses_rng:
            self._replay(places)

    def _replay(self, places):
        """Each module in `replayed` initialises its own params on temporary
        tensors, which go to the groups; then the params are bound back."""
        taken = set()  # params that have their values (reset_parameters: the first registrant's)
        for path, mod in self.replayed:
            direct = list(mod.named_parameters(recurse=False))
            bound = [p.data for _, p in direct]
            for _, p in direct:
                p.data = torch.empty(p.shape, dtype=self.meta.get(id(p), p.dtype))
            with torch.no_grad():
                if self.fn:
                    self.fn(mod)
                else:
                    mod.reset_parameters()
            for name, p in direct:
                if mod._parameters[name] is not p:
                    raise ValueError(
                        f"zerocore.wrap: initialising {_module_label(path, mod)} replaced its parameter {name} with "
                        "a new object; initialise params in place (nn.init.*, p.data.normal_()): the engine and "
                        "the optimizer hold the original")
                if id(p) in self.meta and (self.fn or id(p) not in taken):
                    taken.add(id(p))
                    group, index = places[id(p)]
                    group.load_param(index, _reads(p.data))
            for (_, p), data in zip(direct, bound):
                p.data = data
