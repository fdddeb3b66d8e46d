"""How wrap lays a module's params out: which stage-3 unit owns each param,
which units are coalesced into one, and the flat groups (state/flat_group.py)
they go into, in reduction order. The engine builds its store from this
plan, and zerocore.estimate (sizing/estimate.py) counts the bytes of the same plan
without allocating any."""
from __future__ import annotations

from torch import nn

from zerocore.state.flat_group import FlatGroup
from zerocore.state.units import Unit, find_units


def param_names(module):
    """id(param) -> every name under which the module holds it (tied weights
    have several), in registration order."""
    names = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for p_name, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            lst = names.setdefault(id(p), [])
            if full not in lst:
                lst.append(full)
    return names


def owning_unit(unit_modules, users) -> int:
    """The unit every use of a param runs inside: the user that contains
    all the others (a weight of a unit, or tied between a unit and a unit
    nested in it); the root when none does (weights tied across unrelated
    units, or between a unit and the root's own modules, such as an
    embedding tied to a head that is a unit)."""
    for i in users:
        if all(j == i or any(m is unit_modules[j] for m in unit_modules[i].modules()) for j in users):
            return i
    return 0


def coalesce(unit_modules, unit_bytes, limit) -> list:
    """Runs of unit indices gathered and reduced as one unit, root first.
    On gloo a small unit's collectives cost their latency, not their bytes,
    so units are coalesced while a run holds at most `limit` bytes
    (unit_bytes: per unit). Only units whose calls are known at wrap join a
    run: consecutive children of one nn.Sequential, which calls each once,
    in order, on the last one's output, so the run's first module starts its
    forward and its last one ends it, and its backward runs in reverse; and
    none holds a unit or is held by one (an expert runs on the data's say).
    Every other unit, the root included, is a run of its own."""
    index = {id(m): i for i, m in enumerate(unit_modules)}
    # Units holding another unit, and units another (not the root) holds.
    nested = set()
    for i, m in enumerate(unit_modules[1:], 1):
        inner = {index[id(sub)] for sub in m.modules() if sub is not m and id(sub) in index}
        nested |= inner | ({i} if inner else set())
    place = {}  # id(module) -> (its nn.Sequential, position), where the Sequential holds it once
    for seq in (m for m in unit_modules[0].modules() if isinstance(m, nn.Sequential)):
        kids = list(seq._modules.values())
        place.update({id(k): (id(seq), at) for at, k in enumerate(kids) if sum(c is k for c in kids) == 1})
    follows = [i > 1 and i not in nested and i - 1 not in nested and id(unit_modules[i]) in place
               and place.get(id(unit_modules[i - 1])) == (place[id(unit_modules[i])][0],
                                                            place[id(unit_modules[i])][1] - 1)
               for i in range(len(unit_modules))]
    runs = [[0]]
    for i in range(1, len(unit_modules)):
        if follows[i] and sum(unit_bytes[j] for j in runs[-1]) + unit_bytes[i] <= limit:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def build_groups(module, params, names, param_group_of, *, config, placement, dtype, reduce_dtype, comm, state_names,
                 units=None):
    """(flat groups in reduction order, with their tags; stage 3's units,
    root first, else []). names: id(param) -> its names; param_group_of: id(param)
    -> its optimizer param group; comm: the world size and rank the groups
    partition over; units: wrap's units= (find_units)."""
    sharded = placement.partitions_params
    unit_modules = find_units(module, units) if sharded else [module]
    # Each module's innermost unit (outer units come first), then each
    # param's users: the innermost units of the modules registering it.
    unit_of = {id(sub): i for i, m in enumerate(unit_modules) for sub in m.modules()}
    users = {}
    for mod in module.modules():
        for p in mod.parameters(recurse=False):
            users.setdefault(id(p), set()).add(unit_of[id(mod)])
    owner = {id(p): owning_unit(unit_modules, users[id(p)]) for p in params}

    def make(ps, trainable, sharded):
        ps = ps[::-1]  # backward order: the reverse of registration
        return FlatGroup(ps, [names[id(p)] for p in ps], [param_group_of.get(id(p), 0) for p in ps],
                         placement=placement, dtype=dtype, reduce_dtype=reduce_dtype, trainable=trainable,
                         sharded=sharded, bucket_bytes=config.bucket_bytes, comm=comm,
                         state_names=state_names if trainable else (), delayed=config.delayed_update,
                         # Config(deterministic=True): the int40 sums in the grad partition's memory
                         exact_sums=(config.deterministic and trainable and placement.partitions_grads
                                     and not placement.optimizer_on_host))

    def split(ps, sharded):
        return [make(sub, t, sharded) for t in (True, False)
                for sub in [[p for p in ps if p.requires_grad == t]] if sub]

    # Params kept whole, unit by unit; the rest are gathered with their unit.
    persistent = [p for i in range(len(unit_modules)) for p in params
                  if owner[id(p)] == i and sharded and p.numel() < config.persist_threshold]
    whole = {id(p) for p in persistent}
    gathered = [p for p in params if id(p) not in whole]
    unit_bytes = [0] * len(unit_modules)
    for p in gathered:
        unit_bytes[owner[id(p)]] += p.numel() * dtype.itemsize
    runs = coalesce(unit_modules, unit_bytes, config.coalesce_limit) if sharded else [[0]]
    built = []
    for index, run in enumerate(runs):
        members = [p for p in gathered if owner[id(p)] in run]
        built.append(Unit(index, [unit_modules[i] for i in run], split(members, sharded=sharded)))
    # Reduction order, the same on every rank: units in backward order (last
    # registered first, the root, whose embeddings finish last, at the end),
    # then the params kept whole.
    groups = [g for u in built[1:][::-1] + built[:1] for g in u.groups] + split(persistent, sharded=False)
    for tag, g in enumerate(groups):
        g.tag = tag
    return groups, (built if sharded else [])
