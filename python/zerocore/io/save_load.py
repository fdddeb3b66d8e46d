"""engine.save and engine.load: checkpoints at any world size and stage.

Save: every rank writes its own partition (fp32 params, optimizer states)
and RNG states into a new folder named by the save's id, with no gather;
rank 0 adds the module's buffers. Once every rank's file is on disk, rank 0
commits the save by renaming the manifest into place, then removes the
folders of older saves. A save that fails or dies on any rank before the
rename leaves the previous checkpoint as it was (io/checkpoint_format.py has
the layout; docs/checkpoint.md, what users need to know).

Load: every rank opens the manifest and the rank files, checks them
against its engine, and reads and checksums every stored tensor it will
use; the ranks agree (one gather of each rank's problem, if any) before
anything of the engine changes, so a bad checkpoint raises CheckpointError
on every rank, with the engine untouched. Then each rank copies what it
holds under its own plan (stage, world size, dtype), straight from the
mapped files.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil

import torch

from zerocore import param_guards
from zerocore.flat_group import FlatGroup
from zerocore.io.checkpoint_format import (FORMAT, MANIFEST, VERSION, CheckpointError, CheckpointReader, rank_file,
                                        stretch_key, write_manifest, write_rank_file)

_SAVE_ID = re.compile(r"[0-9a-f]{16}")


def _agree(comm, problem: str, what: str):
    """Every rank's problem, or none: raises CheckpointError on every rank
    when any rank has one, naming the ranks and their problems."""
    problems = comm.gather_text(problem)
    failed = [(r, p) for r, p in enumerate(problems) if p]
    if failed:
        lines = "\n".join(f"  rank {r}: {p}" for r, p in failed)
        raise CheckpointError(f"{what} failed on {len(failed)} rank(s), and on every rank:\n{lines}")


def _problem(fn) -> str:
    """fn's error as text ("" when it succeeds). Any error: a rank that
    raised instead of joining the agreement would leave the others waiting."""
    try:
        fn()
        return ""
    except Exception as e:  # noqa: BLE001 - every error is reported to every rank
        return f"{type(e).__name__}: {e}"


def _json(value, what):
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise ValueError(f"engine.save: {what} is not JSON-serialisable ({e})") from None


def _no_pending_grads(engine, verb):
    if engine._backward_calls:
        raise ValueError(f"engine.{verb}: {engine._backward_calls} backward pass(es) since the last step; "
                         f"{verb} between steps (after engine.step(), or engine.zero_grad() to give the step up), "
                         "where no gradients are pending")


def _params(engine):
    """(param, every name the module gives it), of every flat group."""
    return [(p, names) for g in engine.groups for p, names in zip(g.params, g.names)]


def _hyper(group) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def manifest_of(engine, save_id, sizes, lr_scheduler, extra) -> dict:
    group_of = {id(p): i for i, g in enumerate(engine.optimizer.param_groups) for p in g["params"]}
    return {
        "format": FORMAT, "version": VERSION, "id": save_id,
        "world_size": engine.comm.world_size, "stage": engine.config.stage, "dtype": engine.config.dtype,
        "step": engine.step_count,
        "loss_scale": engine.scaler.state_dict(),
        "exact_grads": engine.exact.state_dict() if engine.exact else None,  # Config(deterministic=True)'s grid
        "optimizer": {"kind": engine.kind, "states": list(engine.state_names),
                      "param_groups": [_hyper(g) for g in engine.optimizer.param_groups]},
        "params": [{"names": names, "shape": list(p.shape), "trainable": p.requires_grad,
                    "group": group_of.get(id(p))} for p, names in _params(engine)],
        "buffers": {name: {"shape": list(b.shape), "dtype": str(b.dtype).replace("torch.", "")}
                    for name, b in engine.module.named_buffers()},
        "state_dict_keys": param_guards.state_dict_keys(engine.module),
        "lr_scheduler": lr_scheduler, "extra": extra,
        "files": [{"path": rank_file(save_id, r, len(sizes)), "bytes": n} for r, n in enumerate(sizes)],
    }


def rank_tensors(engine) -> dict:
    """What this rank writes: its stretches of every group's fp32 params and
    optimizer states, its RNG states, and (rank 0) the module's buffers."""
    rank, out = engine.comm.rank, {}
    for g in engine.groups:
        if g.plan.world_size == 1 and rank != 0:
            continue  # replicated on every rank (stage 0): rank 0 writes it
        buffers = {"param": g.fp32_partition(), **g.state}
        for kind, buf in buffers.items():
            for index, first, values in g.owned_stretches(buf):
                out[stretch_key(kind, g.names[index][0], first)] = values
    if rank == 0:  # rank 0's buffers are the ones every forward broadcasts
        for name, b in engine.module.named_buffers():
            out[f"buffer/{name}"] = b.detach().contiguous()
    out["rng/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng/cuda/{i}"] = state
    return out


def save(engine, path, lr_scheduler=None, extra=None):
    comm = engine.comm
    path = os.fspath(path)
    scheduler_state, extra_state = None, None

    def check():
        nonlocal scheduler_state, extra_state
        _no_pending_grads(engine, "save")
        if lr_scheduler is not None:
            scheduler_state = _json(lr_scheduler.state_dict(), "lr_scheduler.state_dict()")
        extra_state = _json(extra, "extra")

    _agree(comm, _problem(check), "engine.save")
    engine.finish_update()  # a delayed update still running is part of the state saved
    save_id = f"{comm.gather_ints(secrets.randbits(63))[0]:016x}"
    file = os.path.join(path, rank_file(save_id, comm.rank, comm.world_size))

    def write():
        os.makedirs(os.path.dirname(file), exist_ok=True)
        write_rank_file(file, save_id, comm.rank, comm.world_size, rank_tensors(engine))

    problem = _problem(write)
    sizes = comm.gather_ints(-1 if problem else os.path.getsize(file))
    try:
        _agree(comm, problem, f"engine.save to {path} (the previous checkpoint there is unchanged)")
    except CheckpointError:
        if comm.rank == 0:
            shutil.rmtree(os.path.join(path, save_id), ignore_errors=True)
        raise
    commit = ""
    if comm.rank == 0:
        commit = _problem(lambda: write_manifest(path, manifest_of(engine, save_id, sizes, scheduler_state,
                                                                 extra_state)))
        if commit:
            shutil.rmtree(os.path.join(path, save_id), ignore_errors=True)
        else:
            _remove_other_saves(path, save_id)
    _agree(comm, commit, f"engine.save to {path} (the previous checkpoint there is unchanged)")


def _remove_other_saves(path, keep):
    """The folders of earlier saves, and of saves that died before their commit."""
    for entry in os.listdir(path):
        if entry != keep and _SAVE_ID.fullmatch(entry) and os.path.isdir(os.path.join(path, entry)):
            shutil.rmtree(os.path.join(path, entry), ignore_errors=True)


# Loading ------------------------------------------------------------------------
def _check_model(engine, ckpt) -> None:
    """Raises CheckpointError when the checkpoint is not of this engine's
    model and optimizer."""
    m, where = ckpt.manifest, os.path.join(ckpt.directory, MANIFEST)
    saved = {e["names"][0]: e for e in m["params"]}
    mine = {names[0]: (p, names) for p, names in _params(engine)}
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or extra:
        raise CheckpointError(f"{where}: another model: params missing from it: {missing[:5] or 'none'}; "
                              f"params it has that this model lacks: {extra[:5] or 'none'}")
    group_of = {id(p): i for i, g in enumerate(engine.optimizer.param_groups) for p in g["params"]}
    for name, (p, _) in mine.items():
        e = saved[name]
        if e["shape"] != list(p.shape):
            raise CheckpointError(f"{where}: another model: {name} is {tuple(e['shape'])} there, "
                                  f"{tuple(p.shape)} here")
        if e["trainable"] != p.requires_grad or e["group"] != group_of.get(id(p)):
            raise CheckpointError(f"{where}: {name} is {'trainable' if e['trainable'] else 'frozen'} in optimizer "
                                  f"param group {e['group']} there, {'trainable' if p.requires_grad else 'frozen'} "
                                  f"in group {group_of.get(id(p))} here")
    opt = m["optimizer"]
    if opt["kind"] != engine.kind or len(opt["param_groups"]) != len(engine.optimizer.param_groups):
        raise CheckpointError(f"{where}: optimizer {opt['kind']} with {len(opt['param_groups'])} param group(s) "
                              f"there, {engine.kind} with {len(engine.optimizer.param_groups)} here")
    buffers = {name: list(b.shape) for name, b in engine.module.named_buffers()}
    if {k: v["shape"] for k, v in m["buffers"].items()} != buffers:
        raise CheckpointError(f"{where}: another model: its buffers differ from this module's")


def plan_reads(engine):
    """What this rank reads: (stretches, kind, param name) per param and
    state of every group, with the (kind, name, first, numel) it asks of
    the checkpoint."""
    loads, wanted = [], []
    for g in engine.groups:
        for index in range(len(g.params)):
            name = g.names[index][0]
            jobs = [(g.param_stretches(index), "param")]
            jobs += [(g.state_stretches(kind, index), kind) for kind in g.state]
            for stretches, kind in jobs:
                loads.append((stretches, kind, name))
                wanted += [(kind, name, first, n) for first, n, _ in stretches]
    return loads, wanted


def load(engine, path, lr_scheduler=None):
    comm, path = engine.comm, os.fspath(path)
    ckpt, loads = None, None

    def check():
        nonlocal ckpt, loads
        _no_pending_grads(engine, "load")
        ckpt = CheckpointReader(path)
        _check_model(engine, ckpt)
        loads, wanted = plan_reads(engine)
        ckpt.verify(wanted)
        for name in ckpt.manifest["buffers"]:
            ckpt.verify_named(f"buffer/{name}")
        for key in ckpt.rng_keys(comm.rank):
            ckpt.verify_named(key, comm.rank)
        if lr_scheduler is not None and ckpt.manifest["lr_scheduler"] is None:
            raise CheckpointError(f"{path}: holds no lr scheduler state (saved without lr_scheduler=)")

    _agree(comm, _problem(check), f"engine.load from {path} (the engine is unchanged)")
    engine.finish_update()  # a delayed update still running must not land on the loaded state
    try:
        _apply(engine, ckpt, loads, lr_scheduler)
    finally:
        ckpt.close()
    return ckpt.manifest["extra"]


def _apply(engine, ckpt, loads, lr_scheduler):
    m = ckpt.manifest
    if engine.scheduler:
        engine.scheduler.free_all()  # no gathered copy of the old values survives
    for stretches, kind, name in loads:
        FlatGroup.load(stretches, lambda first, n, kind=kind, name=name: ckpt.read(kind, name, first, n))
    with torch.no_grad():
        for name, b in engine.module.named_buffers():
            b.copy_(ckpt.get(f"buffer/{name}").view(b.shape))
    rank = engine.comm.rank
    for key in ckpt.rng_keys(rank):
        state = ckpt.get(key, rank).clone()
        if key == "rng/cpu":
            torch.random.set_rng_state(state)
        elif torch.cuda.is_available() and int(key.rsplit("/", 1)[1]) < torch.cuda.device_count():
            torch.cuda.set_rng_state(state, int(key.rsplit("/", 1)[1]))
    engine.step_count = m["step"]
    engine.scaler.load_state_dict(m["loss_scale"])
    if engine.exact and m.get("exact_grads"):
        engine.exact.load_state_dict(m["exact_grads"])
    set_hyperparameters(engine.optimizer, m["optimizer"]["param_groups"])
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(m["lr_scheduler"])


def set_hyperparameters(optimizer, saved_groups):
    """Each param group's hyperparameters as a manifest holds them (JSON's lists as tuples: betas)."""
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
