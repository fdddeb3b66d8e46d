"""build_parts: the parts an engine trains with (EngineParts), built in
the order they need one another from the module, the optimizer and the
config; and what building needs besides: the process groups it trains
over and the steps of building that every rank takes together.

Every check a rank can fail alone (its model, its memory, its initial
values) ends in an agreement: the ranks gather who failed before the next
collective, and every rank raises, instead of the others waiting for the
failed one in a collective it never issues. The first of them
(checks.check_same_model) runs before any other collective of the engine.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from zerocore import _native
from zerocore.runtime import compute_stream, devices
from zerocore._native import EngineCore
from zerocore.comm.communicator import Communicator
from zerocore.config import Config
from zerocore.engine.checks import check_same_model, model_problem, warn_of_param_dtypes
from zerocore.engine.optimizer_bridge import read_optimizer, state_names
from zerocore.state.exact_grads import ExactGradSum
from zerocore.hooks.grad_reducer import FullGradReducer, StagedReducer
from zerocore.state.grouping import build_groups, param_names
from zerocore.ops.loss_scale import LossScaler
from zerocore.state.materialize import Initializer
from zerocore.state.offload import OffloadUpdate, host_memory_problem
from zerocore.state.partition_update import InPlaceUpdate
from zerocore.state.placement import Placement
from zerocore.comm.positions import Positions
from zerocore.comm.process_group import private_group
from zerocore.hooks.stage3 import UnitScheduler
from zerocore.io import snapshot_transport as snapshot_transports
from zerocore.state import guards
from zerocore.state.flat_group import TORCH_DTYPES


@dataclasses.dataclass(frozen=True)
class EngineParts:
    """What an engine trains with, built once (build_parts) and held by
    each of its parts (training.py, state_io.py, reports.py); what changes
    from step to step is the TrainingLoop's (training.StepProgress)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer  # the user's, driven by the engine (optimizer_bridge.drive_engine)
    config: Config
    placement: Placement
    kind: str  # the optimizer's algorithm ("adam", "adamw", "sgd")
    state_names: tuple  # its fp32 state arrays per partition
    # Where it trains, decided in one place: the device, and the native
    # backend every queue, store and pipeline of the engine runs on.
    device: torch.device
    backend: object
    compute_stream: object  # torch's current stream, followed between steps (compute_stream.py)
    dtype: torch.dtype  # the params' training dtype (Config.dtype)
    scaler: LossScaler
    # Where this rank is in the engine, for its peers: a collective that waits long finds ranks in different ones.
    positions: Positions
    # The communicators: the control plane's (None without a process
    # group), the data's, stages 2-3's reductions' and stage 3's rounds'.
    control: Optional[Communicator]
    comm: Communicator
    reduce_comm: Optional[Communicator]
    rounds_comm: Optional[Communicator]
    groups: list  # the flat groups (state/flat_group.py)
    units: list  # stage 3's units (grouping.py); empty at stages 0-2
    exact: Optional[ExactGradSum]  # Config(deterministic=True): the grads' exact sums
    update: object  # where this rank's partition is updated: InPlaceUpdate or OffloadUpdate
    core: EngineCore  # the native core, which owns the native parts below: reduction, stage 3's schedule, the step
    zero_step: object  # core.zero_step: the step in one native call
    param_gather: object  # core.param_gather: stages 1-3's updated blocks into every rank's params
    reducer: object  # FullGradReducer (stages 0-1) or StagedReducer (stages 2-3)
    scheduler: Optional[UnitScheduler]  # stage 3's
    state_guards: list  # stage 3: module.state_dict() and load_state_dict() refuse while params are released
    # A param of each group held whole, in the dtype it trains in: a cast after wrap raises at the forward.
    dtype_probes: list
    # (param, trainable, name) as planned: requires_grad is checked at each backward.
    planned_trainable: list
    num_trainable_params: int
    root_numel: int  # stage 3: the root unit's trainable params, gathered once per backward (accounting.py)
    padding_elems: int
    buffer_dtypes: dict  # the module's buffers' own dtypes, which close() gives back
    snapshot_group: object  # Config(snapshot="memory"): the snapshots' gloo group (restores, the mirrors' addresses)
    snapshot_transport: object  # and how their mirrors travel (io/snapshot_transport.py)


def build_parts(module, optimizer, config=None, *, group=None, units=None, init=None, device=None,
                backend=None) -> EngineParts:
    """The parts of an engine that trains `module` with `optimizer`'s
    algorithm (zerocore.wrap has the arguments). Every rank builds them
    together: the checks agree, and the collectives run in one order."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"zerocore.wrap: expected a torch.nn.Module, got {type(module).__name__}")
    if getattr(module, "_zerocore_engine", None) is not None:
        raise ValueError("zerocore.wrap: this module is already wrapped; wrap the original module once")
    cfg = Config.from_any(config)
    placement = Placement.of(cfg)
    spec = read_optimizer(optimizer)
    params = list(module.parameters())
    names = param_names(module)
    where = devices.decide([(names[id(p)][0], p.device) for p in params] +
                           [(name, b.device) for name, b in module.named_buffers()], backend, device)
    backend = where.backend
    stream = compute_stream.of(backend)
    process_group = training_process_group(group, placement, where)
    # The control plane (agreements, the step's exchange, stage 3's
    # rounds) runs on host process groups beside the data's, so agreeing
    # never waits behind data collectives nor, with NCCL for data, makes
    # the GPU synchronise. Their queues are streams of the same backend.
    control_group = engine_process_group(process_group, cfg.timeout, "gloo")
    positions = Positions.of(control_group, cfg.diagnose_after)
    control = Communicator(control_group, backend=backend, plane=_native.StreamPlane.CONTROL,
                           positions=positions, name="control") if process_group is not None else None
    comm = Communicator(engine_process_group(process_group, cfg.timeout), fails_with=control,
                        control=control, backend=backend, nccl=cfg.nccl, positions=positions)
    # Host waits on device work stuck behind a collective its peers never issue diagnose as collectives do.
    positions.watch(backend, comm.failure)
    dtype, reduce_dtype = TORCH_DTYPES[cfg.dtype], TORCH_DTYPES[cfg.reduce_dtype]
    warn_of_param_dtypes(params, names, dtype)
    scaler = LossScaler(cfg.loss_scale, cfg.dtype)
    kind, optimizer_states = spec.kind, state_names(spec)

    initializer = Initializer(module, params, names, init)
    problem = model_problem(params, names, spec, where) or initializer.problem
    check_same_model(comm, cfg, spec, params, names, initializer, failed=problem is not None)
    if problem is not None:
        raise problem
    param_group_of = {id(p): i for i, group in enumerate(spec.param_groups) for p in group["params"]}
    initializer.materialize(where.device)
    groups, units = build_groups(module, params, names, param_group_of, config=cfg, placement=placement,
                                 dtype=dtype, reduce_dtype=reduce_dtype, comm=comm, state_names=optimizer_states,
                                 units=units)
    comm.names.groups = [g.label for g in groups]  # errors name a collective's params
    allocate_agreeing(groups, placement, comm)
    for g in groups:
        g.fill(initializer.values_later)
    fill_agreeing(initializer, comm, param_places(groups))
    for g in groups:
        g.binder.note_param_versions()
    update = OffloadUpdate(groups, placement, cfg, backend) if placement.optimizer_on_host else InPlaceUpdate()
    buffer_dtypes = {name: b.dtype for name, b in module.named_buffers(remove_duplicate=False)}
    cast_buffers(module, lambda _, b: dtype if b.is_floating_point() else b.dtype)

    # Stages 2-3 reduce during backward on a queue of their own (its own
    # stream and process group, as FSDP2's reduce-scatter stream), so no
    # gather waits behind a reduction queued before it.
    reduce_comm = rounds_comm = None
    exact = ExactGradSum(groups, comm, placement) if cfg.deterministic else None
    if placement.partitions_grads:
        reduce_comm = Communicator(engine_process_group(process_group, cfg.timeout), fails_with=comm,
                                   control=control, backend=backend, nccl=cfg.nccl, names=comm.names,
                                   positions=positions, name="reductions")
    if placement.partitions_params:
        # The rounds run on a host process group of their own, so that none waits
        # behind the data collectives queued before it, nor the step's
        # agreements behind a round in flight.
        rounds_comm = Communicator(engine_process_group(process_group, cfg.timeout, "gloo"), fails_with=comm,
                                   backend=backend, plane=_native.StreamPlane.CONTROL, positions=positions,
                                   name="rounds")
    # The native core, built and connected from the groups' stores, the
    # units and the placement: stages 0-1's reduction or stages 2-3's
    # reducer, stage 3's unit schedule (whose rounds reduce each unit's
    # grads), the param gather after the update, offload's host update,
    # and the step in one native call (the reduction's end, the sum of
    # squares, the exchange with the late grads, the decision with the
    # loss scaler, the update and the gather or stage 3's end-of-step round).
    snapshot_group = engine_process_group(process_group, cfg.timeout, "gloo") if cfg.snapshot else None
    snapshot_transport = snapshot_transports.for_engine(snapshot_group, process_group, where.device, cfg.timeout,
                                                        cfg.nccl) if cfg.snapshot else None
    offload = placement.optimizer_on_host
    group_index = {id(g): i for i, g in enumerate(groups)}
    core = EngineCore(
        comm.queue, comm.control_queue,
        [(g.store, g.tag, exact.sums_of(g) if exact and g.trainable else None) for g in groups],
        [(u.index == 0, [group_index[id(g)] for g in u.groups]) for u in units],
        stage=placement.stage, reductions=reduce_comm.queue if reduce_comm else None,
        rounds=rounds_comm.queue if rounds_comm else None,
        offload=update.native if offload else None, delays_from=cfg.delays_from if offload else None,
        loss_scaler=scaler.native, prefetch_bytes=cfg.prefetch_bytes)
    update.use(core)
    reducer = StagedReducer(groups, core, exact=exact) if placement.partitions_grads \
        else FullGradReducer(groups, core)
    scheduler = UnitScheduler(units, core.schedule, backend, _unit_grads_attacher(reducer)) \
        if placement.partitions_params else None
    return EngineParts(
        module=module, optimizer=optimizer, config=cfg, placement=placement, kind=kind, state_names=optimizer_states,
        device=where.device, backend=backend, compute_stream=stream, dtype=dtype, scaler=scaler, positions=positions,
        control=control, comm=comm, reduce_comm=reduce_comm, rounds_comm=rounds_comm, groups=groups, units=units,
        exact=exact, update=update,
        core=core, zero_step=core.zero_step, param_gather=core.param_gather, reducer=reducer, scheduler=scheduler,
        state_guards=guards.guard_module_state(module, {id(p) for u in units for g in u.groups for p in g.params}),
        dtype_probes=[(g.params[0], g.names[0][0], g.params[0].dtype) for g in groups if g.params and not g.sharded],
        planned_trainable=[(p, g.trainable, p_names[0]) for g in groups for p, p_names in zip(g.params, g.names)],
        num_trainable_params=sum(p.numel() for p in params if p.requires_grad),
        root_numel=sum(s.numel for g in units[0].groups if g.trainable for s in g.slots) if units else 0,
        padding_elems=sum(g.plan.padding_elems for g in groups if g.trainable),
        buffer_dtypes=buffer_dtypes,
        snapshot_group=snapshot_group, snapshot_transport=snapshot_transport)


def _unit_grads_attacher(reducer) -> Callable:
    """Stage 3, before a unit's backward (UnitScheduler's on_unit_backward):
    its trainable groups' grads become views into gradient reduction's staging."""
    def attach(unit):
        for g in unit.groups:
            if g.trainable:
                reducer.attach_grad_views(g)
    return attach


def param_places(groups) -> dict:
    """id(param) -> (its flat group, its index there)."""
    return {id(p): (g, i) for g in groups for i, p in enumerate(g.params)}


def cast_buffers(module, dtype_of):
    """Each of the module's buffers to dtype_of(its name, the buffer)."""
    for mod_name, mod in module.named_modules():
        for name, b in list(mod.named_buffers(recurse=False)):
            dtype = None if b is None else dtype_of(f"{mod_name}.{name}" if mod_name else name, b)
            if dtype is not None and b.dtype != dtype:
                setattr(mod, name, b.to(dtype))


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
