"""The engine's state in and out: the full state dict, loading one
(a state dict or a safetensors file), checkpoints (save and load, in
io/save_load.py), and the full params visible on the module for a while
(gathered_params). Every one of them first lets a delayed offload update
land (finish_update), so what goes out or comes in is the latest.
"""
from __future__ import annotations

import contextlib
import os

from zerocore import param_guards
from zerocore.io import save_load
from zerocore.state.grouping import param_names
from zerocore.state.materialize import IncompatibleKeys, Loader
from zerocore.comm.positions import engine_call


class StateIO:
    """Engine's state I/O (engine.py holds the state)."""

    # State dicts -----------------------------------------------------------
    @engine_call("full_state_dict()")
    def full_state_dict(self) -> dict:
        """Full fp32 params under every name the module gives them, and the
        module's buffers, on every rank; loadable by module.load_state_dict."""
        self.finish_update()
        self._sync_buffers()
        out = {}
        for g in self.groups:
            flat = g.full_fp32()
            for i, (p_names, shape) in enumerate(zip(g.names, g.shapes)):
                value = g.view(flat, "param", i).view(shape).clone()
                for name in p_names:
                    out[name] = value
        for name, b in self.module.named_buffers():
            out[name] = b.detach().clone()
        return {k: out[k] for k in param_guards.state_dict_keys(self.module)}

    @engine_call("load_state_dict()")
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
        loader = Loader(source, self.module, list(self.module.parameters()), param_names(self.module),
                        where="engine.load_state_dict", what="the source", strict=strict)
        self.comm.raise_together(loader.problem, "engine.load_state_dict: the source does not fit the model on "
                                 "rank(s) {ranks} (their error says why); no rank loaded it. Give every rank the "
                                 "same source")
        self.finish_update()
        if self.scheduler:  # no gathered copy of the old values may outlive the load
            self.scheduler.free_all()
        loader.load(self._places())
        return IncompatibleKeys(loader.missing, loader.unexpected)

    def _places(self) -> dict:
        """id(param) -> (its flat group, its index there)."""
        return {id(p): (g, i) for g in self.groups for i, p in enumerate(g.params)}

    # Checkpoints -------------------------------------------------------------
    @engine_call("save()")
    def save(self, path, lr_scheduler=None, extra=None):
        """Saves a checkpoint into the folder `path` (docs/checkpoint.md):
        every rank writes its own partition of the fp32 params and optimizer
        states, its RNG states, and rank 0 the module's buffers, with the step
        count, the loss scale, the optimizer's hyperparameters and, when
        given, lr_scheduler.state_dict() and `extra` (anything JSON can
        hold: an epoch, a data position). Call it on every rank, between
        steps. The save replaces the one in `path` only once every rank's
        files are on disk: one that fails or dies leaves the last one whole."""
        save_load.save(self, path, lr_scheduler, extra)
        if self.snapshots:  # named when a snapshot cannot be restored
            self.snapshots.last_checkpoint = os.path.abspath(path)

    @engine_call("load()")
    def load(self, path, lr_scheduler=None):
        """Loads a checkpoint saved at any world size and stage, in any
        training dtype, into this engine (and lr_scheduler, when given);
        returns the `extra` it was saved with. Every rank checks the files
        and checksums it will read, and the ranks agree, before anything
        changes: a missing, truncated, corrupt or mismatched checkpoint
        raises zerocore.CheckpointError on every rank, with the engine as
        it was. Call it on every rank, between steps."""
        return save_load.load(self, path, lr_scheduler)

    # Full params on the module ---------------------------------------------
    @contextlib.contextmanager
    def gathered_params(self):
        """Full params visible on the module (stage 3 gathers them; other
        stages hold them already). Edits made inside are kept: changed
        elements go to the shards and fp32 masters on exit."""
        self.comm.failure.check()  # refused after a failed collective, as every call (positions.engine_call)
        with self.positions.inside("gathered_params()", self.step_count + 1):
            self.finish_update()
            if self.scheduler:
                self.scheduler.gather_all()
            before = [g.snapshot_partition() for g in self.groups]
        try:
            yield self.module
        finally:
            with self.positions.inside("the end of gathered_params()", self.step_count + 1):
                for g, snap in zip(self.groups, before):
                    g.write_back(snap)
                if self.scheduler:
                    self.scheduler.free_all()
