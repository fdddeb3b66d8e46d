"""A unit is a module whose params are gathered together: by default the
modules held directly by the outermost nn.ModuleList/nn.Sequential
containers (the transformer blocks of a typical model; ModuleDicts are
looked through, having no forward of their own), the modules held by a
ModuleList or ModuleDict inside such a unit (the experts of a mixture-of-
experts layer), plus the root for everything else.
"""
from __future__ import annotations

from torch import nn


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

    def visit(m, inside_unit):
        for child in m.children():
            listed = isinstance(m, containers) if inside_unit else isinstance(m, (nn.ModuleList, nn.Sequential))
            if listed and not isinstance(child, containers) and any(True for _ in child.parameters()):
                picked.append(child)
                visit(child, True)
            else:
                visit(child, inside_unit)

    visit(module, False)
    return [module] + picked


class Unit:
    def __init__(self, index, modules, groups):
        self.index = index  # in the native schedule; the root is 0
        # The modules gathered as this unit: one, or a run coalesced at wrap
        # (grouping.coalesce), in the order their nn.Sequential calls them.
        self.modules = modules
        self.groups = groups  # FlatGroups of sharded params
        self.schedule = None  # set by UnitScheduler
        self.elems = 0  # of its buffer, and its groups' (start, end) in it: set by UnitScheduler
        self.spans = []

    @property
    def gathered(self) -> bool:
        """Gathered, or being gathered, in the pool (prefetches count)."""
        return self.schedule is not None and self.schedule.gathered(self.index)
