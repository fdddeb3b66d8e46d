"""What building an engine needs besides its parts (engine.py builds them):
the process groups it trains over, the checks of the model and optimizer,
the steps of building that every rank takes together, and how many staging
buffers gradient reduction is planned with.

Every check a rank can fail alone (its model, its memory, its initial
values) ends in an agreement: the ranks gather who failed before the next
collective, and every rank raises, instead of the others waiting for the
failed one in a collective it never issues. The first of them
(check_same_model) runs before any other collective of the engine.
"""
from __future__ import annotations

import dataclasses
import hashlib
import warnings

import torch
import torch.distributed as dist

from zerocore.runtime import devices
from zerocore.state.offload import host_memory_problem
from zerocore.comm.process_group import private_group


# The process groups ---------------------------------------------------------
def engine_process_group(group, timeout, backend=None):
    """A process group of the same ranks for the engine alone: its
    collectives run on native threads and may still be in flight when
    control returns to the user (a prefetch, a round), so they must never
    share a group with the user's own collectives. Its timeout: `timeout`
    (Config.timeout), or else `group`'s. Its backend: `backend`, or else
    the default's."""
    return None if group is None else private_group(group, timeout, backend)


def training_process_group(group, placement, where):
    """The process group to train over: `group`, or the world's. A group
    whose backend cannot move the module's tensors (where.device's) raises
    here, alike on every rank, before any collective; a module wrap
    refuses (where.problem) raises on every rank once the ranks agree."""
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    if group is None:
        if placement.partitions_optimizer:
            raise ValueError(f"zerocore.wrap: stage {placement.stage} partitions across ranks and needs a process "
                             "group; call torch.distributed.init_process_group() first (or torchrun), or pass group=")
        problem = devices.missing_group_problem(where.device)
        if problem is not None:
            raise ValueError(problem)
        return None
    if where.problem is None:
        backend = dist.get_backend_config(group)
        problem = devices.group_problem(devices.device_types(backend), backend, where.device.type)
        if problem is not None:
            raise ValueError(problem)
    return group



# The model's checks ---------------------------------------------------------
def model_problem(params, names, spec, where):
    """The error this rank's model or optimizer earns before wrapping, or
    None (meta params are the Initializer's to check). where: the
    devices.Decision."""
    if where.problem is not None:
        return ValueError(where.problem)
    bad = [names[id(p)][0] for p in params if not p.is_floating_point()]
    if bad:
        return TypeError(f"zerocore.wrap: parameter(s) {', '.join(bad)} are not floating point")
    in_optimizer = {id(p) for param_group in spec.param_groups for p in param_group["params"]}
    missing = [names[id(p)][0] for p in params if p.requires_grad and id(p) not in in_optimizer]
    if missing:
        return ValueError(f"zerocore.wrap: parameter(s) {', '.join(missing)} require grad but are not in the "
                          "optimizer; pass them to it or set requires_grad=False")
    unknown = [i for i, param_group in enumerate(spec.param_groups) for p in param_group["params"]
               if id(p) not in names]
    if unknown:
        return ValueError(f"zerocore.wrap: optimizer param group {unknown[0]} holds a tensor that is not a "
                          "parameter of this module")
    return None


def warn_of_param_dtypes(params, names, dtype: torch.dtype):
    """A model whose params are in 16 bits, wrapped to train in another dtype
    (a bf16 checkpoint with the default fp32 Config): the engine trains in
    Config.dtype, which the user may not know they chose."""
    other = [(names[id(p)][0], p.dtype) for p in params if p.is_floating_point() and p.dtype != dtype
             and p.dtype in (torch.bfloat16, torch.float16)]
    if other:
        theirs = other[0][1]
        warnings.warn(
            f"zerocore.wrap: {len(other)} of the model's params are {theirs} ({other[0][0]}, ...), but the engine "
            f"trains in {dtype} (Config.dtype): their values are copied into {dtype} params, computed in {dtype}. To train in {theirs} (with fp32 master weights), "
            f"pass Config(dtype={'bf16' if theirs == torch.bfloat16 else 'fp16'!r}); to train in {dtype}, "
            f"model.to({dtype}) before wrap silences this.", stacklevel=4)  # the caller of zerocore.wrap


def _hash(data: bytes, bits: int) -> int:
    """A hash of `data`, the same in every process (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> (64 - bits)


def check_same_model(comm, config, spec, params, names, initializer, failed):
    """Ranks compare a hash of config, optimizer, names, shapes,
    trainability and how params get their values before any other
    collective: a different model on one rank fails on every rank with
    this message instead of deadlocking. When every rank draws the
    initial values from its own RNG (meta params), the hash holds the
    RNG state too, since ranks that disagree on it would train different
    models. A rank that `failed` its own checks sends -1, so the others
    raise too instead of waiting for it in the next collective."""
    # Config.snapshot_dir is the node's own folder: it may differ from node to node.
    desc = repr((dataclasses.replace(config, snapshot_dir=None), spec.kind, len(spec.param_groups), initializer.kind,
                 [(names[id(p)], tuple(p.shape), p.requires_grad) for p in params]))
    rng = _hash(bytes(torch.get_rng_state().tolist()), 31) if initializer.uses_rng else 0
    # One int64 a rank: the model's hash above the RNG's, to tell which differs.
    hashes = comm.gather_ints(-1 if failed else _hash(desc.encode(), 32) << 31 | rng)
    if failed:
        return
    rejected = [r for r, x in enumerate(hashes) if x == -1]
    if rejected:
        raise ValueError(f"zerocore.wrap: rank(s) {rejected} rejected the model (their error says why); "
                         "no rank wrapped it")
    odd = [r for r, x in enumerate(hashes) if x != hashes[0]]
    if odd and all(x >> 31 == hashes[0] >> 31 for x in hashes):
        raise ValueError(f"zerocore.wrap: the random number generators of rank(s) {odd} differ from rank 0's; "
                         "every rank initialises the meta-device params from its own CPU RNG, so seed every "
                         "rank alike (torch.manual_seed) before building the model and wrapping it, and draw "
                         "no random numbers on some ranks only in between")
    if odd:
        raise ValueError(f"zerocore.wrap: ranks disagree on the model, config or optimizer: rank(s) {odd} "
                         "differ from rank 0; every rank must wrap the same model with the same config")


# Building together ----------------------------------------------------------
def allocate_agreeing(flat_groups, placement, comm):
    """Every flat group's buffers, on every rank or on none: a host that
    cannot hold the offloaded states, or an allocation that fails on
    some rank, raises on every rank, naming the bytes, before the first
    broadcast of the params' values."""
    if placement.optimizer_on_host:
        problem = host_memory_problem(flat_groups, comm)
        if problem is not None:
            raise problem
    error = None
    try:
        for g in flat_groups:
            g.allocate()
    except MemoryError as e:
        need = {at: sum(g.planned_bytes(at) for g in flat_groups) for at in ("device", "host")}
        error = MemoryError(f"zerocore.wrap: allocating this rank's model states failed ({need['device']:,} bytes "
                            f"where training runs and {need['host']:,} bytes on the host): {e}")
    comm.raise_together(error, "zerocore.wrap: allocating the model states failed on rank(s) {ranks} "
                        "(their error names the bytes); no rank wrapped the model", MemoryError)


def fill_agreeing(initializer, comm, places):
    """initializer.fill(places), on every rank; where it raises on some
    ranks (a user's init function, a file one rank cannot read), every rank
    raises, instead of the others waiting for it in the next collective."""
    if initializer.kind is None:
        return
    error = None
    try:
        initializer.fill(places)
    except Exception as e:  # noqa: BLE001 - re-raised below, after the ranks agree
        error = e
    comm.raise_together(error, "zerocore.wrap: initialising the params failed on rank(s) {ranks} (their "
                        "error says why); no rank wrapped the model")
