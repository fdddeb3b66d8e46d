"""The engine's state in and out (StateIO): the full state dict, loading one
(a state dict or a safetensors file), checkpoints (save and load, in
save_load.py), and the full params visible on the module for a while
(gathered_params). Every one of them first lets a delayed offload update
land (finish_update), so what goes out or comes in is the latest.
"""
from __future__ import annotations

import contextlib
import os

from zerocore.io import save_load
from zerocore.engine.build import EngineParts, param_places
from zerocore.engine.training import TrainingLoop
from zerocore.state.grouping import param_names
from zerocore.state.materialize import IncompatibleKeys, Loader
from zerocore.comm.positions import engine_call
from zerocore.state import guards


class StateIO:
    """The state of `parts` in and out; `loop` lands a delayed update
    first (finish_update) and holds the step count saved and loaded;
    `snapshots` (Config(snapshot="memory"), else None) hear of each save."""

    def __init__(self, parts: EngineParts, loop: TrainingLoop, snapshots=None):
        self.parts, self.loop = parts, loop
        self.progress = loop.progress  # the step and micro-batch engine_call notes (positions.py)
        self.snapshots = snapshots

    # State dicts -----------------------------------------------------------
    @engine_call("full_state_dict()")
    def full_state_dict(self) -> dict:
        """Engine.full_state_dict has the contract."""
        self.loop.finish_update()
        self.loop.sync_buffers()
        out = {}
        for g in self.parts.groups:
            flat = g.full_fp32()
            for i, (p_names, shape) in enumerate(zip(g.names, g.shapes)):
                value = g.view(flat, "param", i).view(shape).clone()
                for name in p_names:
                    out[name] = value
        for name, b in self.parts.module.named_buffers():
            out[name] = b.detach().clone()
        self._wait_for_the_device()
        return {k: out[k] for k in guards.state_dict_keys(self.parts.module)}

    def _wait_for_the_device(self):
        """The host waits here for the device work issued so far (its
        gathers; none on the CPU, where it ran already), in the backend's
        watched host wait, rather than later in torch's copy of the result
        to the host (the user's torch.save), which cannot be watched: a
        gather its peers never issue (the call made on one rank) is then a
        RankDisagreementError within Config(diagnose_after=...), not a wait
        for the timeout (docs/rank_disagreement.md)."""
        backend = self.parts.backend
        backend.host_wait(backend.record(backend.compute_stream()))

    @engine_call("load_state_dict()")
    def load_state_dict(self, source, strict=True) -> IncompatibleKeys:
        """Engine.load_state_dict has the contract."""
        module = self.parts.module
        loader = Loader(source, module, list(module.parameters()), param_names(module),
                        where="engine.load_state_dict", what="the source", strict=strict)
        self.parts.comm.raise_together(loader.problem, "engine.load_state_dict: the source does not fit the model on "
                                 "rank(s) {ranks} (their error says why); no rank loaded it. Give every rank the "
                                 "same source")
        self.loop.finish_update()
        if self.parts.scheduler:  # no gathered copy of the old values may outlive the load
            self.parts.scheduler.free_all()
        loader.load(param_places(self.parts.groups))
        return IncompatibleKeys(loader.missing, loader.unexpected)

    # Checkpoints -------------------------------------------------------------
    @engine_call("save()")
    def save(self, path, lr_scheduler=None, extra=None):
        """Engine.save has the contract."""
        self._wait_for_the_device()  # for the update and the gathers before it, where the host waits watched
        save_load.save(self.parts, self.loop, path, lr_scheduler, extra)
        if self.snapshots:  # named when a snapshot cannot be restored
            self.snapshots.last_checkpoint = os.path.abspath(path)

    @engine_call("load()")
    def load(self, path, lr_scheduler=None):
        """Engine.load has the contract."""
        return save_load.load(self.parts, self.loop, path, lr_scheduler)

    # Full params on the module ---------------------------------------------
    @contextlib.contextmanager
    def gathered_params(self):
        """Engine.gathered_params has the contract."""
        parts = self.parts
        parts.comm.failure.check()  # refused after a failed collective, as every call (positions.engine_call)
        with parts.positions.inside("gathered_params()", self.progress.step_count + 1):
            self.loop.finish_update()
            if parts.scheduler:
                parts.scheduler.gather_all()
            before = [g.binder.snapshot_partition() for g in parts.groups]
            self._wait_for_the_device()
        try:
            yield parts.module
        finally:
            with parts.positions.inside("the end of gathered_params()", self.progress.step_count + 1):
                for g, snap in zip(parts.groups, before):
                    g.binder.write_back(snap)
                if parts.scheduler:
                    parts.scheduler.free_all()
