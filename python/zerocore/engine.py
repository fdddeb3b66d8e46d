"""zerocore.wrap and the Engine it returns: a module trained with ZeRO.

The engine builds the model states from the plan (see flat_group.py for
where they live per stage) and the native schedule over them: the comm
queues (comm/communicator.py) and the native core (EngineCore, engine/engine_core.h:
gradient reduction, stage 3's UnitSchedule, the post-step param
all-gather and the step, built and connected natively); then it runs
forward through the module, backward through autograd with the hooks that
drive that schedule (hooks/grad_reducer.py, hooks/stage3.py), and steps the
partitioned native optimizer in one call.

The engine is one object in five files, by concern:

    engine.py           wrap; Engine: the parts it trains with, built in
                        __init__ in the order they need one another, and
                        close(), which lets them go
    engine_build.py     what building needs besides: the process groups,
                        the model's checks, the steps the ranks take together
    engine_training.py  the training loop (Training): forward, backward,
                        step, zero_grad, clip_grad_norm_
    engine_state_io.py  state in and out (StateIO): full_state_dict,
                        load_state_dict, save, load, gathered_params
    engine_reports.py   memory_report, comm_stats, loss_scale (Reports)

Mixins, not parts the engine holds and forwards to: every concern works on
the same parts (the flat groups, the communicators, the reducer, stage 3's
scheduler, the native step), which __init__ builds and names in one place,
and io/save_load.py, the accounting and the tests read them on the engine.
Parts of their own would each hold those (or the engine) again, and Engine
would be a list of methods that forward to them.
"""
from __future__ import annotations

import weakref

from torch import nn

from zerocore import _native, param_guards
from zerocore.runtime import compute_stream
from zerocore.runtime import devices
from zerocore._native import EngineCore
from zerocore.comm.communicator import Communicator
from zerocore.config import Config
from zerocore.engine_build import (allocate_agreeing, check_same_model, engine_process_group, fill_agreeing,
                                   model_problem, training_process_group,
                                   warn_of_param_dtypes)
from zerocore.engine_reports import Reports
from zerocore.engine_state_io import StateIO
from zerocore.engine_training import Training
from zerocore.state.exact_grads import ExactGradSum
from zerocore.flat_group import TORCH_DTYPES
from zerocore.hooks.grad_reducer import FullGradReducer, StagedReducer
from zerocore.state.grouping import build_groups, param_names
from zerocore.ops.loss_scale import LossScaler
from zerocore.state.materialize import Initializer
from zerocore.state.offload import OffloadUpdate
from zerocore.optim import drive_engine, read_optimizer, state_names
from zerocore.optim import release as release_optimizer
from zerocore.state.partition_update import InPlaceUpdate
from zerocore.state.placement import Placement
from zerocore.comm.positions import Positions
from zerocore.io.snapshot import Snapshots
from zerocore.io.snapshot_restore import restore as restore_snapshots
from zerocore.hooks.stage3 import UnitScheduler


class Engine(Training, StateIO, Reports):
    """A module trained with ZeRO: zerocore.wrap makes one (its docstring
    has the arguments)."""

    def __init__(self, module, optimizer, config=None, *, group=None, units=None, init=None, device=None,
                 backend=None):
        if not isinstance(module, nn.Module):
            raise TypeError(f"zerocore.wrap: expected a torch.nn.Module, got {type(module).__name__}")
        if getattr(module, "_zerocore_engine", None) is not None:
            raise ValueError("zerocore.wrap: this module is already wrapped; wrap the original module once")
        self.config = cfg = Config.from_any(config)
        self.placement = placement = Placement.of(cfg)
        spec = read_optimizer(optimizer)
        self.module = module
        params = list(module.parameters())
        names = param_names(module)
        # Where it trains, decided in one place: the device, and the native
        # backend every queue, store and pipeline of the engine runs on.
        where = devices.decide([(names[id(p)][0], p.device) for p in params] +
                               [(name, b.device) for name, b in module.named_buffers()], backend, device)
        self.device, self.backend = where.device, where.backend
        self.compute_stream = compute_stream.of(self.backend)  # torch's current stream, followed between steps
        process_group = training_process_group(group, placement, where)
        # The control plane (agreements, the step's exchange, stage 3's
        # rounds) runs on host process groups beside the data's, so agreeing
        # never waits behind data collectives nor, with NCCL for data, makes
        # the GPU synchronise. Their queues are streams of the same backend.
        control_group = engine_process_group(process_group, cfg.timeout, "gloo")
        # Where this rank is in the engine, for its peers: a collective that waits long finds ranks in different ones.
        self.positions = Positions.of(control_group, cfg.diagnose_after)
        weakref.finalize(self, self.positions.close)  # its publishing thread ends with the engine, closed or not
        self.control = Communicator(control_group, backend=self.backend, plane=_native.StreamPlane.CONTROL,
                                    positions=self.positions, name="control") if process_group is not None else None
        self.comm = Communicator(engine_process_group(process_group, cfg.timeout), fails_with=self.control,
                                 control=self.control, backend=self.backend, nccl=cfg.nccl, positions=self.positions)
        self.dtype = TORCH_DTYPES[cfg.dtype]
        warn_of_param_dtypes(params, names, self.dtype)
        self.reduce_dtype = TORCH_DTYPES[cfg.reduce_dtype]
        self.scaler = LossScaler(cfg.loss_scale, cfg.dtype)
        self.kind = spec.kind
        self.state_names = state_names(spec)
        self.step_count = 0

        initializer = Initializer(module, params, names, init)
        problem = model_problem(params, names, spec, where) or initializer.problem
        check_same_model(self.comm, cfg, spec, params, names, initializer, failed=problem is not None)
        if problem is not None:
            raise problem
        param_group_of = {id(p): i for i, group in enumerate(spec.param_groups) for p in group["params"]}
        initializer.materialize(self.device)
        self.groups, self.units = build_groups(module, params, names, param_group_of, config=cfg,
                                               placement=placement, dtype=self.dtype, reduce_dtype=self.reduce_dtype,
                                               comm=self.comm, state_names=self.state_names, units=units)
        self.comm.names.groups = [g.label for g in self.groups]  # errors name a collective's params
        allocate_agreeing(self.groups, placement, self.comm)
        for g in self.groups:
            g.fill(initializer.values_later)
        fill_agreeing(initializer, self.comm, self._places())
        for g in self.groups:
            g.note_param_versions()
        self.num_trainable_params = sum(p.numel() for p in params if p.requires_grad)
        # A param of each group held whole, in the dtype it trains in: a cast after wrap raises at the forward.
        self._dtype_probes = [(g.params[0], g.names[0][0], g.params[0].dtype) for g in self.groups
                              if g.params and not g.sharded]
        # requires_grad as planned, checked at each backward (_note_trainability).
        self._planned_trainable = [(p, g.trainable, p_names[0]) for g in self.groups
                                   for p, p_names in zip(g.params, g.names)]
        # Stage 3: the root unit's trainable params, gathered once per backward (accounting.predicted_comm).
        self.root_numel = sum(s.numel for g in self.units[0].groups if g.trainable for s in g.slots) \
            if self.units else 0
        # Where this rank's partition is updated: one native call a step.
        self.update = OffloadUpdate(self.groups, placement, cfg, self.backend) if placement.optimizer_on_host \
            else InPlaceUpdate()
        self.padding_elems = sum(g.plan.padding_elems for g in self.groups if g.trainable)
        # close() gives the buffers their dtype back.
        self._buffer_dtypes = {name: b.dtype for name, b in module.named_buffers(remove_duplicate=False)}
        self._cast_buffers(lambda _, b: self.dtype if b.is_floating_point() else b.dtype)

        self.scheduler = None
        # Stages 2-3 reduce during backward on a queue of their own (its own
        # stream and process group, as FSDP2's reduce-scatter stream), so no
        # gather waits behind a reduction queued before it.
        self.reduce_comm = None
        # Config(deterministic=True): the grads' exact sums replace the float reduction's.
        self.exact = ExactGradSum(self.groups, self.comm, placement) if cfg.deterministic else None
        if placement.partitions_grads:
            self.reduce_comm = Communicator(engine_process_group(process_group, cfg.timeout), fails_with=self.comm,
                                            control=self.control, backend=self.backend, nccl=cfg.nccl,
                                            names=self.comm.names, positions=self.positions, name="reductions")
        if placement.partitions_params:
            # The rounds run on a host process group of their own, so that none waits
            # behind the data collectives queued before it, nor the step's
            # agreements behind a round in flight.
            self.rounds_comm = Communicator(engine_process_group(process_group, cfg.timeout, "gloo"),
                                            fails_with=self.comm, backend=self.backend,
                                            plane=_native.StreamPlane.CONTROL, positions=self.positions,
                                            name="rounds")
        # The native core, built and connected from the groups' stores, the
        # units and the placement: stages 0-1's reduction or stages 2-3's
        # reducer, stage 3's unit schedule (whose rounds reduce each unit's
        # grads), the param gather after the update, offload's host update,
        # and the step in one native call (the reduction's end, the sum of
        # squares, the exchange with the late grads, the decision with the
        # loss scaler, the update and the gather or stage 3's end-of-step round).
        offload = placement.optimizer_on_host
        group_index = {id(g): i for i, g in enumerate(self.groups)}
        self.core = EngineCore(
            self.comm.queue, self.comm.control_queue,
            [(g.store, g.tag, self.exact.sums_of(g) if self.exact and g.trainable else None) for g in self.groups],
            [(u.index == 0, [group_index[id(g)] for g in u.groups]) for u in self.units],
            stage=placement.stage, reductions=self.reduce_comm.queue if self.reduce_comm else None,
            rounds=self.rounds_comm.queue if placement.partitions_params else None,
            offload=self.update.native if offload else None, delays_from=cfg.delays_from if offload else None,
            loss_scaler=self.scaler.native, prefetch_bytes=cfg.prefetch_bytes)
        self.update.use(self.core)
        self.zero_step = self.core.zero_step
        self.param_gather = self.core.param_gather  # stages 1-3: every rank's updated blocks into its full params
        self.reducer = StagedReducer(self.groups, self.core, exact=self.exact) if placement.partitions_grads \
            else FullGradReducer(self.groups, self.core)
        if placement.partitions_params:
            self.scheduler = UnitScheduler(self.units, self.core.schedule, self.backend, self._attach_unit_grads)
        # Stage 3: module.state_dict() and load_state_dict() refuse while params are released.
        self._state_guards = param_guards.guard_module_state(
            module, {id(p) for u in self.units for g in u.groups for p in g.params})
        # The user's optimizer drives the engine (optim.drive_engine); its
        # param_groups hold the hyperparameters every step reads.
        self.optimizer = optimizer
        # Config(snapshot="memory"): a snapshot after steps (io/snapshot.py), mirrored over a group of its own.
        self.snapshots = Snapshots(self, engine_process_group(process_group, cfg.timeout, "gloo")) \
            if cfg.snapshot else None
        drive_engine(optimizer, self.snapshots.step if self.snapshots else self._step,
                     self.zero_grad)
        # Per step: the backward calls, the reduced grads' global squared norm once taken,
        # clip_grad_norm_'s bound, and trainability changes noted.
        self._forget_reduction()
        module._zerocore_engine = self
        # The completed steps the state restored from snapshots holds, for the loop to go on from (0: none).
        self.restored_step = restore_snapshots(self.snapshots) if self.snapshots else 0

    def _cast_buffers(self, dtype_of):
        """Each buffer to dtype_of(its name, the buffer)."""
        for mod_name, mod in self.module.named_modules():
            for name, b in list(mod.named_buffers(recurse=False)):
                dtype = None if b is None else dtype_of(f"{mod_name}.{name}" if mod_name else name, b)
                if dtype is not None and b.dtype != dtype:
                    setattr(mod, name, b.to(dtype))

    def snapshot_lr_scheduler(self, lr_scheduler):
        """Config(snapshot="memory"): names the lr scheduler whose state the
        snapshots keep (docs/snapshots.md); after a restore it takes the
        state restored."""
        if not self.snapshots:
            raise ValueError("engine.snapshot_lr_scheduler: this engine takes no snapshots; set "
                             "zerocore.Config(snapshot=\"memory\")")
        self.snapshots.keep_lr_scheduler(lr_scheduler)

    # Ending ----------------------------------------------------------------
    def close(self) -> nn.Module:
        """Ends training with this engine and hands the module back as a plain
        torch module: its params hold the full fp32 values (full_state_dict's)
        in memory of their own, its buffers their own dtype again. What the
        engine made goes now, not at some later garbage collection: its
        hooks, native buffers and threads (its process groups stay with
        torch.distributed until destroy_process_group()). Call it on every
        rank (stage 3 gathers the params). The module may be wrapped again;
        the engine and engine.optimizer refuse any further use."""
        module, state = self.module, self.full_state_dict()
        for handles in (getattr(self.scheduler, "handles", []), self.reducer.hooks, self._state_guards):
            for h in handles:
                h.remove()
        for name, p in module.named_parameters():
            p.grad = None
            param_guards.restore(p, state[name])
        self._cast_buffers(lambda name, _: self._buffer_dtypes[name])  # rank 0's values since full_state_dict
        del module._zerocore_engine
        release_optimizer(self.optimizer)
        if self.snapshots:  # the last one written and mirrored
            self.snapshots.close()
        comms = [self.comm, self.reduce_comm, self.rounds_comm if self.scheduler else None, self.control]
        for comm in filter(None, comms):  # what is in flight (stage 3's prefetch for the next forward) lands first
            comm.close()
        self.positions.close()
        self.__dict__.clear()  # the native objects and buffers go
        self.__class__ = _ClosedEngine
        return module


class _ClosedEngine:
    """What an engine is after close()."""

    def __getattr__(self, name):
        raise RuntimeError(f"zerocore: engine.{name}: this engine was closed (engine.close()); wrap the module "
                           "again to go on training")

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)  # raises


def wrap(module, optimizer, config=None, *, group=None, units=None, init=None, device=None, backend=None) -> Engine:
    """Wraps `module` for ZeRO training with `optimizer`'s algorithm and
    hyperparameters. It takes the optimizer over: its step() and zero_grad()
    become the engine's, its param_groups hold the hyperparameters each step
    reads (schedulers on it apply), and engine.optimizer is the same object.

    config: a zerocore.Config or a dict of its fields.
    group: the torch.distributed process group (default: the world).
    units: stage 3: module classes or modules to gather as units (default:
        the children of the outermost ModuleList/Sequential containers).
    init: where params on the meta device (built inside zerocore.init())
        get their values, each rank materialising only what it holds:
        None, each module's reset_parameters(), with the values eager
        construction gives after the same seed (seed every rank alike); a
        function called on each module that holds meta params, as
        model.apply(fn) (init=model._init_weights); or a state_dict or the
        path of a safetensors file, which sets every param (meta or not)
        and the buffers it holds. zerocore/state/materialize.py says how.
    device: where params and buffers on the meta device are materialised
        and train ("cuda", "cuda:1", a torch.device; default: the CPU). A
        model larger than the GPU, built inside zerocore.init(), trains
        there with device="cuda" and Config(offload_params="cpu"): only
        each rank's part ever exists, and on the host.
    backend: the native backend the engine runs on (zerocore._native:
        CpuBackend, CheckingBackend, CudaBackend), for tests that check or
        compare backends; by default the module's device decides
        (zerocore/runtime/devices.py): the process's default backend on the CPU, a
        CudaBackend on a CUDA device. It must run the module's device.
    """
    return Engine(module, optimizer, config, group=group, units=units, init=init, device=device, backend=backend)
