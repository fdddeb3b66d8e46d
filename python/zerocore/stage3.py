"""Stage 3: parameters live as shards; a unit's params are gathered just
before the unit runs (forward, and again in backward) and freed after.

A unit is a module whose params are gathered together: by default the
modules held directly by the outermost nn.ModuleList/nn.Sequential
containers (the transformer blocks of a typical model; ModuleDicts and
nested lists are looked through, having no forward of their own), plus the
root for everything else. Every rank must run the same units in the same
order; what happens inside a unit may differ between ranks (mixture-of-
experts routing inside a block), since the unit is gathered and reduced
whole. A model whose ranks skip whole units (experts held directly by a
top-level list) must name coarser units with wrap(..., units=[...]).

Schedule, with no recorded trace:
- forward: a unit's pre-hook gathers it (waiting for a prefetch if one is
  in flight) and prefetches the units that followed it in the previous
  step's forward, up to prefetch_bytes; when its inputs need grads it
  routes them through _PostBackward, to find its post-backward point. Its
  post-hook frees it and, when its outputs need grads, hooks them so that
  backward gathers it again before its grads are computed, prefetching the
  unit that ran before it in this step's forward;
- backward: a unit is freed at its post-backward point, when the grads of
  its inputs are complete: every param its backward reads (frozen weights
  that input grads need included) has been read by then. A unit whose
  inputs need no grad (the first one) stays gathered until backward ends,
  when every unit still gathered is freed;
- a forward under no_grad (eval) frees each unit after it runs.
Prefetch is only ever a guess: a wrong one costs a gather, never a wrong
result, and every rank makes the same guesses.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten


def find_units(module: nn.Module, units=None) -> list:
    """The unit modules, root first. `units` may list module classes or
    modules to use instead of the default policy."""
    if units is not None:
        classes = tuple(u for u in units if isinstance(u, type))
        chosen = {id(u) for u in units if isinstance(u, nn.Module)}
        picked = [m for m in module.modules() if m is not module and (id(m) in chosen or isinstance(m, classes))]
        return [module] + picked

    picked = []
    containers = (nn.ModuleList, nn.ModuleDict)  # hold modules, have no forward

    def visit(m):
        for child in m.children():
            in_list = isinstance(m, (nn.ModuleList, nn.Sequential))
            if in_list and not isinstance(child, containers) and any(True for _ in child.parameters()):
                picked.append(child)
            else:
                visit(child)

    visit(module)
    return [module] + picked


class Unit:
    def __init__(self, module, groups):
        self.module = module
        self.groups = groups  # FlatGroups of sharded params
        self.pending = []  # all-gather handles in flight
        # Calls of this unit whose backward began (pre-backward) and has not
        # reached its post-backward point: a unit called twice is released
        # only after the backward of both calls.
        self.open_backwards = 0
        self.nbytes = sum(g.full.numel() * g.full.element_size() for g in groups)

    @property
    def gathered(self) -> bool:
        return bool(self.pending) or any(g.gathered for g in self.groups)

    def start_gather(self, count=True):
        if not self.gathered:
            self.pending = [w for g in self.groups for w in g.gather_async(count)]

    def wait(self):
        for w in self.pending:
            w.wait()
        self.pending = []

    def free(self):
        self.wait()
        for g in self.groups:
            if g.gathered:
                g.free()


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs. Its backward runs once the grads of all
    of them are complete, from inside the unit only: the unit's
    post-backward point (FSDP2 marks it the same way). A tensor hook on the
    inputs would wait for their uses outside the unit too."""

    @staticmethod
    def forward(ctx, hook, *inputs):
        ctx.hook = hook
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook()
        return (None, *grads)


class UnitScheduler:
    def __init__(self, units, prefetch_bytes: int, on_unit_backward=None):
        self.units = units
        self.prefetch_bytes = prefetch_bytes
        self.on_unit_backward = on_unit_backward or (lambda unit: None)
        self.in_backward = False
        self.forward_order = []  # this step's first-run order
        self.last_forward_order = []
        self.handles = []
        for u in units:
            self.handles.append(u.module.register_forward_pre_hook(self._pre_forward(u), with_kwargs=True))
            self.handles.append(u.module.register_forward_hook(self._post_forward(u)))

    # Forward ---------------------------------------------------------------
    def _pre_forward(self, unit):
        def hook(module, args, kwargs):
            unit.start_gather()
            unit.wait()
            if not self.in_backward:
                if unit not in self.forward_order:
                    self.forward_order.append(unit)
                self._prefetch_after(unit, self.last_forward_order)
            return self._mark_post_backward(unit, args, kwargs)
        return hook

    def _mark_post_backward(self, unit, args, kwargs):
        """Routes the inputs that need grads through _PostBackward. Under
        no_grad (reentrant checkpointing's first pass) nothing is recorded;
        its recomputation in backward, with grads enabled, records it."""
        flat, spec = tree_flatten((args, kwargs))
        need = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not need or not torch.is_grad_enabled():
            return None
        marked = _PostBackward.apply(self._post_backward(unit), *(flat[i] for i in need))
        for i, t in zip(need, marked):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _post_forward(self, unit):
        def hook(module, args, output):
            if self.in_backward:  # recomputation for checkpointing
                return output
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward(unit), mode="any")
            unit.free()
            return output
        return hook

    def _prefetch_after(self, unit, order):
        """Starts gathering the unit after `unit` in `order`, and the ones
        after it while they fit in the prefetch byte budget."""
        if unit not in order or self.prefetch_bytes <= 0:
            return
        budget = self.prefetch_bytes
        for i, nxt in enumerate(order[order.index(unit) + 1:]):
            if i > 0 and nxt.nbytes > budget:
                break
            budget -= nxt.nbytes
            nxt.start_gather()

    def end_forward(self):
        """After the root's forward: drop prefetches that were not used."""
        if not self.in_backward:
            for u in self.units:
                u.free()

    # Backward --------------------------------------------------------------
    def begin_backward(self):
        self.in_backward = True

    def _pre_backward(self, unit):
        def hook(_grad):
            unit.open_backwards += 1
            unit.start_gather()
            unit.wait()
            self.on_unit_backward(unit)
            backward_order = self.forward_order[::-1]
            self._prefetch_after(unit, backward_order)
        return hook

    @staticmethod
    def _post_backward(unit):
        def hook():
            unit.open_backwards = max(0, unit.open_backwards - 1)
            if unit.open_backwards == 0:
                unit.free()
        return hook

    def end_backward(self):
        for u in self.units:
            u.open_backwards = 0
            u.free()
        self.in_backward = False

    def end_step(self):
        """Called once per optimizer step: this step's order guides the next."""
        if self.forward_order:
            self.last_forward_order = self.forward_order
        self.forward_order = []

    def gather_all(self):
        """Every unit, for gathered_params (not counted as training traffic)."""
        for u in self.units:
            u.start_gather(count=False)
        for u in self.units:
            u.wait()

    def free_all(self):
        for u in self.units:
            u.free()
