"""zerocore.wrap and the Engine it returns: a module trained with ZeRO.

The engine builds the model states from the plan (see state/flat_group.py
for where they live per stage) and the native schedule over them: the comm
queues (comm/communicator.py) and the native core (EngineCore, engine/engine_core.h:
gradient reduction, stage 3's UnitSchedule, the post-step param
all-gather and the step, built and connected natively); then it runs
forward through the module, backward through autograd with the hooks that
drive that schedule (grad_reducer.py, stage3.py), and steps the
partitioned native optimizer in one call.

Engine is a facade over parts, each given what it needs:

    build.py             build_parts: EngineParts, what the engine trains
                         with, built in the order they need one another
                         (checks.py: the model's checks before)
    training.py          TrainingLoop: forward, backward, the step,
                         zero_grad, clip_grad_norm_; it owns StepProgress
                         (meeting.py: the ranks' meetings in a step)
    state_io.py          StateIO: full_state_dict, load_state_dict, save,
                         load, gathered_params
    reports.py           Reports: memory_report, comm_stats, loss_scale
    optimizer_bridge.py  the user's optimizer read, and taken over to drive
                         the TrainingLoop

Each method of Engine says which part does the work; the tests and
benches reach the parts as engine.parts.
"""
from __future__ import annotations

import contextlib
import weakref

from torch import nn

from zerocore.engine.build import EngineParts, build_parts, cast_buffers
from zerocore.engine.optimizer_bridge import drive_engine
from zerocore.engine.optimizer_bridge import release as release_optimizer
from zerocore.engine.reports import Reports
from zerocore.engine.state_io import StateIO
from zerocore.engine.training import TrainingLoop, training_call
from zerocore.state.materialize import IncompatibleKeys
from zerocore.io.snapshot import Snapshots
from zerocore.io.snapshot_restore import restore as restore_snapshots
from zerocore.state import guards


class Engine:
    """A module trained with ZeRO: zerocore.wrap makes one (its docstring
    has the arguments)."""

    def __init__(self, module, optimizer, config=None, *, group=None, units=None, init=None, device=None,
                 backend=None):
        self.parts: EngineParts = build_parts(module, optimizer, config, group=group, units=units, init=init,
                                              device=device, backend=backend)
        weakref.finalize(self, self.parts.positions.close)  # its publishing thread ends with the engine, closed or not
        self._loop = TrainingLoop(self.parts)
        # Config(snapshot="memory"): a snapshot after steps (snapshot.py), mirrored over a group of its own.
        self.snapshots = Snapshots(self.parts, self._loop) if self.parts.config.snapshot else None
        self._state = StateIO(self.parts, self._loop, self.snapshots)
        self._reports = Reports(self.parts, self.snapshots)
        # The user's optimizer drives the engine; its param_groups hold the hyperparameters every step reads.
        drive_engine(optimizer, self.snapshots.step if self.snapshots else self._loop.step, self._loop.zero_grad)
        module._zerocore_engine = self
        # The completed steps the state restored from snapshots holds, for the loop to go on from (0: none).
        self.restored_step = restore_snapshots(self.snapshots) if self.snapshots else 0

    # What the engine trains, and where -------------------------------------
    @property
    def module(self) -> nn.Module:
        return self.parts.module

    @property
    def optimizer(self):
        return self.parts.optimizer

    @property
    def config(self):
        return self.parts.config

    @property
    def device(self):
        return self.parts.device

    @property
    def backend(self):
        return self.parts.backend

    @property
    def num_trainable_params(self) -> int:
        return self.parts.num_trainable_params

    @property
    def root_numel(self) -> int:
        """Stage 3: the root unit's trainable params, gathered once per backward (accounting.predicted_comm)."""
        return self.parts.root_numel

    @property
    def step_count(self) -> int:
        """The steps applied."""
        return self._loop.progress.step_count

    # Training (TrainingLoop) -----------------------------------------------
    def __call__(self, *args, **kwargs):
        return self._loop.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Runs the module. Floating-point inputs are cast to the training
        dtype; buffers come from rank 0, as DDP does."""
        return self._loop.forward(*args, **kwargs)

    def train(self, mode: bool = True):
        """As nn.Module.train(mode): the module's training mode (dropout,
        batch norm's statistics); returns the engine."""
        self.parts.module.train(mode)
        return self

    def eval(self):
        """As nn.Module.eval(): the module in evaluation mode, until
        engine.train(); returns the engine."""
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.parts.module.training

    def backward(self, loss):
        """loss.backward() with gradient reduction. Call it k times before
        step() to accumulate: grads sum over calls and average over ranks."""
        self._loop.backward(loss)

    @training_call
    def step(self) -> bool:
        """Applies the accumulated gradients. Returns False when an fp16
        overflow on any rank skipped the step (on every rank). It is the
        optimizer's step(), which the engine took over (optimizer_bridge)."""
        return self.parts.optimizer.step()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0):
        """Clips this step's grads to the global norm max_norm, as
        torch.nn.utils.clip_grad_norm_ does, and returns their global norm
        (over every param and rank, before clipping; inf or NaN when a grad
        is). Call it on every rank, between the last engine.backward() of a
        step and engine.step(), which applies the clipped grads. With
        Config(max_grad_norm) too, the smaller bound wins."""
        return self._loop.clip_grad_norm_(max_norm, norm_type)

    def zero_grad(self):
        """Zeroes the grads (a step's reduced ones too, after a step that
        raised); every param's .grad is None. After a failed collective it
        refuses, as every call does (positions.engine_call)."""
        self._loop.zero_grad()

    def finish_update(self):
        """Offload with a delayed update: the update still running on the
        host finishes and its params go up (and, in stages 1-2, to every
        rank), so the module and the engine hold the latest params. Reading
        or saving the model calls it first; nothing to do otherwise. Call
        it on every rank. Before it, writes the user made to params held
        whole reach the fp32 masters (ParamBinder.carry_param_writes), and
        the device's verdicts not read yet are (a step it refused raises
        NonFiniteGradientError here, on every rank)."""
        self._loop.finish_update()

    # State in and out (StateIO) --------------------------------------------
    def full_state_dict(self) -> dict:
        """Full fp32 params under every name the module gives them, and the
        module's buffers, on every rank; loadable by module.load_state_dict."""
        return self._state.full_state_dict()

    def load_state_dict(self, source, strict=True) -> IncompatibleKeys:
        """Sets the params and buffers from `source`, a state_dict or the path
        of a safetensors file (full_state_dict's counterpart): on every rank
        what it holds, the full params or its shard, and the fp32 master,
        exactly the source's values; a file is read only where this rank
        holds params. Optimizer states are left as they are. Call it on every
        rank: the ranks check their sources first, and if any rank's does
        not fit (a missing or unexpected key, with strict; a shape that
        differs), every rank raises and nothing is changed.
        Returns the missing and unexpected keys, as Module.load_state_dict."""
        return self._state.load_state_dict(source, strict)

    def save(self, path, lr_scheduler=None, extra=None):
        """Saves a checkpoint into the folder `path` (docs/checkpoint.md):
        every rank writes its own partition of the fp32 params and optimizer
        states, its RNG states, and rank 0 the module's buffers, with the step
        count, the loss scale, the optimizer's hyperparameters and, when
        given, lr_scheduler.state_dict() and `extra` (anything JSON can
        hold: an epoch, a data position). Call it on every rank, between
        steps. The save replaces the one in `path` only once every rank's
        files are on disk: one that fails or dies leaves the last one whole."""
        self._state.save(path, lr_scheduler, extra)

    def load(self, path, lr_scheduler=None):
        """Loads a checkpoint saved at any world size and stage, in any
        training dtype, into this engine (and lr_scheduler, when given);
        returns the `extra` it was saved with. Every rank checks the files
        and checksums it will read, and the ranks agree, before anything
        changes: a missing, truncated, corrupt or mismatched checkpoint
        raises zerocore.CheckpointError on every rank, with the engine as
        it was. Call it on every rank, between steps."""
        return self._state.load(path, lr_scheduler)

    def gathered_params(self) -> contextlib.AbstractContextManager:
        """Full params visible on the module (stage 3 gathers them; other
        stages hold them already). Edits made inside are kept: changed
        elements go to the shards and fp32 masters on exit."""
        return self._state.gathered_params()

    def snapshot_lr_scheduler(self, lr_scheduler):
        """Config(snapshot="memory"): names the lr scheduler whose state the
        snapshots keep (docs/snapshots.md); after a restore it takes the
        state restored."""
        if not self.snapshots:
            raise ValueError("engine.snapshot_lr_scheduler: this engine takes no snapshots; set "
                             "zerocore.Config(snapshot=\"memory\")")
        self.snapshots.keep_lr_scheduler(lr_scheduler)

    # Reports (Reports) -------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self._reports.loss_scale()

    def memory_report(self) -> dict:
        """Bytes of model states held on this rank: params, grads, optimizer
        states (fp32 master, moments), module buffers; plus the buffers
        collectives work in (comm_buffers: gradient reduction's staging, in
        stage 3 the pool units are gathered into, the step's exchange row,
        a few bytes of pinned host memory, and with offloaded grads the
        pinned buffer of one reduced shard they land in), which are not model
        states. Stage 3 params count their shard. All of it is allocated at
        wrap: the report is the same before the first step and after, except
        that stage 3's gather pool grows once (a slot, kept) when ranks need
        more units at the same time than planned (different experts on
        different ranks, units nested in units). "activations": the buffers
        zerocore.checkpoint keeps activation checkpoints in on this rank
        (allocated once, sized on the first step; with offload, the device
        buffers it packs into and copies back into appear during it).
        "by_device": the same categories split by where they live:
        "device" (where training runs) and "host" (what offload moved there:
        Config.offload_optimizer/offload_params, zerocore.checkpoint's
        offload="cpu"). "snapshots" (with Config(snapshot="memory")): the
        host and shared memory the in-memory snapshots hold on this rank, as
        of the last one written (Snapshots.bytes_held), and on a GPU the
        device buffers their mirrors are staged through."""
        return self._reports.memory_report()

    def comm_stats(self) -> dict:
        """Elements moved by each kind of collective ({"all_gather",
        "reduce_scatter", "all_reduce"}), each counted at its full,
        unpartitioned size, since wrap or the last reset_comm_stats(): reset
        before a step to measure one step (zerocore.accounting.predicted_comm
        gives the formula). Control traffic (the start-up model check, the
        step's norm exchange, buffer broadcasts) is not counted. With
        offload_optimizer, "offload" adds the bytes copied between the device
        and the host: {"grad_bytes_to_host", "param_bytes_to_device"}."""
        return self._reports.comm_stats()

    def reset_comm_stats(self):
        """Starts a new comm_stats() window at zero."""
        self._reports.reset_comm_stats()

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
        parts = self.parts
        module, state = parts.module, self.full_state_dict()
        for handles in (getattr(parts.scheduler, "handles", []), parts.reducer.hooks, parts.state_guards):
            for h in handles:
                h.remove()
        for name, p in module.named_parameters():
            p.grad = None
            guards.restore(p, state[name])
        cast_buffers(module, lambda name, _: parts.buffer_dtypes[name])  # rank 0's values since full_state_dict
        del module._zerocore_engine
        release_optimizer(parts.optimizer)
        if self.snapshots:  # the last one written and mirrored
            self.snapshots.close()
        for comm in filter(None, [parts.comm, parts.reduce_comm, parts.rounds_comm, parts.control]):
            comm.close()  # what is in flight (stage 3's prefetch for the next forward) lands first
        parts.positions.close()
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
        and the buffers it holds. zerocore/materialize.py says how.
    device: where params and buffers on the meta device are materialised
        and train ("cuda", "cuda:1", a torch.device; default: the CPU). A
        model larger than the GPU, built inside zerocore.init(), trains
        there with device="cuda" and Config(offload_params="cpu"): only
        each rank's part ever exists, and on the host.
    backend: the native backend the engine runs on (zerocore._native:
        CpuBackend, CheckingBackend, CudaBackend), for tests that check or
        compare backends; by default the module's device decides
        (zerocore/devices.py): the process's default backend on the CPU, a
        CudaBackend on a CUDA device. It must run the module's device.
    """
    return Engine(module, optimizer, config, group=group, units=units, init=init, device=device, backend=backend)
