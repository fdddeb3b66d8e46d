"""The paper's formulas for model-state memory and communication per step.

Notation (docs/formulas.md): Ψ trainable parameters, N data-parallel
ranks, P bytes per param and per grad in the training dtype (2 for bf16/fp16,
4 for fp32), K bytes of optimizer state per param (Adam: m and v, plus an
fp32 master copy when training in 16 bits: 12 for bf16/fp16, 8 for fp32;
SGD with momentum: 4, plus the master).

Memory per rank, by stage:
    0: P Ψ params, P Ψ grads, K Ψ optimizer
    1: P Ψ,        P Ψ,       K Ψ / N
    2: P Ψ,        P Ψ / N,   K Ψ / N
    3: P Ψ / N,    P Ψ / N,   K Ψ / N

Communication per optimizer step, in elements, each collective counted at
its full (unpartitioned) size, with k backward calls per step:
    0: all-reduce Ψ
    1: reduce-scatter Ψ, all-gather Ψ
    2: reduce-scatter k Ψ (each backward reduces as it goes), all-gather Ψ
    3: reduce-scatter k Ψ, all-gather 2 k Ψ (forward and backward), less
       k Ψ_root: the root unit (the params no other unit holds: embeddings,
       head) stays gathered from its forward through its backward, as in
       FSDP2, so it is gathered once per backward call

Offload (docs/offload.md) moves what the step reads to the host
(offload_optimizer, stages 1-3): the grads it reads (stage 1: a copy of
the rank's partition beside the full grads; stages 2-3: the partition
itself, and with delayed_update a second one), the fp32 master (also in
fp32 training) and the optimizer states, plus, training in 16 bits, a
16-bit copy of the partition's params (counted as params). Stage 3's
param shards go too with offload_params. Frozen params are params only:
held as trainable ones are, with no grads or optimizer state.

memory_coefficients holds these rules, as bytes per param by category and
by where they live; predicted_memory_by_device and predicted_memory are
its products, largest_numel its inverse (zerocore.estimate and
zerocore.largest_model, sizing/estimate.py, put them to use).
"""
from __future__ import annotations

import math
from fractions import Fraction

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CATEGORIES = ("param", "grad", "optim")
PLACES = ("device", "host")


def optimizer_state_bytes(optimizer: str, dtype: str, momentum: bool = True, offload: bool = False) -> int:
    """K: bytes of optimizer state per param ("adam", "adamw" or "sgd"):
    the states, plus the fp32 master copy when training in 16 bits or with
    the optimizer offloaded (the host step updates a master of its own)."""
    master = 4 if dtype != "fp32" or offload else 0
    if optimizer in ("adam", "adamw"):
        return 8 + master
    if optimizer == "sgd":
        return (4 if momentum else 0) + master
    raise ValueError(f"unknown optimizer {optimizer!r}; use adam, adamw or sgd")


def memory_coefficients(stage: int, world_size: int, dtype: str, state_bytes: int, *, reduce_dtype: str = None,
                        offload_optimizer: bool = False, offload_params: bool = False,
                        delayed_update: bool = False) -> dict:
    """Bytes per param held on each rank, exact fractions:
    {"trainable" | "frozen": {"device" | "host": {"param", "grad", "optim"}}}.
    state_bytes: K (optimizer_state_bytes, with offload= as here)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if (offload_optimizer and stage == 0) or (offload_params and (stage != 3 or not offload_optimizer)):
        raise ValueError(f"stage {stage} cannot offload {'params' if offload_params else 'the optimizer'} "
                         "(offload_optimizer: stages 1-3; offload_params: stage 3 with offload_optimizer)")
    p, r, shard = BYTES[dtype], BYTES[reduce_dtype or dtype], Fraction(1, world_size)
    part = shard if stage >= 1 else 1  # the optimizer's share of the params on this rank
    step_at = "host" if offload_optimizer else "device"
    per = {kind: {at: dict.fromkeys(CATEGORIES, Fraction(0)) for at in PLACES} for kind in ("trainable", "frozen")}
    for kind in per:
        if stage < 3:
            per[kind]["device"]["param"] += p
        else:
            per[kind]["host" if offload_params else "device"]["param"] += p * shard
    t = per["trainable"]
    t[step_at]["optim"] += state_bytes * part
    if stage < 2:
        t["device"]["grad"] += r
    else:
        t[step_at]["grad"] += r * shard
    if offload_optimizer:
        if stage < 2 or delayed_update:  # the host's own copy of the reduced partition, or the second of two
            t["host"]["grad"] += r * shard
        if dtype != "fp32":  # the host step's 16-bit output, copied up
            t["host"]["param"] += p * shard
    return per


def _number(x: Fraction):
    return int(x) if x.denominator == 1 else float(x)


def predicted_memory_by_device(stage: int, numel: int, world_size: int, dtype: str, state_bytes: int, *,
                               frozen_numel: int = 0, **placement) -> dict:
    """Bytes of model states per rank by where they live:
    {"device" | "host": {"param", "grad", "optim"}}. numel: Ψ, trainable
    params; frozen_numel: params that do not train. placement:
    memory_coefficients' keyword arguments (offload, reduce_dtype)."""
    per = memory_coefficients(stage, world_size, dtype, state_bytes, **placement)
    return {at: {k: _number(per["trainable"][at][k] * numel + per["frozen"][at][k] * frozen_numel)
                 for k in CATEGORIES} for at in PLACES}


def predicted_memory(stage: int, numel: int, world_size: int, dtype: str, state_bytes: int, **kwargs) -> dict:
    """Bytes of model states per rank: {"param", "grad", "optim"}, wherever
    they live (predicted_memory_by_device's arguments)."""
    by = predicted_memory_by_device(stage, numel, world_size, dtype, state_bytes, **kwargs)
    return {k: _number(Fraction(by["device"][k]) + Fraction(by["host"][k])) for k in CATEGORIES}


def largest_numel(memory: int, stage: int, world_size: int, dtype: str, state_bytes: int, *,
                  host_memory: int = None, granularity: int = 1, **placement):
    """The inverse of predicted_memory_by_device: the most trainable params
    (a multiple of granularity) whose model states fit in `memory` bytes on
    each rank's device and, when given, `host_memory` bytes on its host.
    math.inf when nothing bounds it (offloaded to a host of unstated size)."""
    per = memory_coefficients(stage, world_size, dtype, state_bytes, **placement)["trainable"]
    best = math.inf
    for at, limit in (("device", memory), ("host", host_memory)):
        rate = sum(per[at].values())
        if limit is not None and rate:
            best = min(best, math.floor(Fraction(limit) / rate))
    return best if best == math.inf else best // granularity * granularity


def predicted_comm(stage: int, numel: int, backward_calls: int = 1, root_numel: int = 0) -> dict:
    """Elements per collective kind for one optimizer step. root_numel:
    stage 3's Ψ_root (engine.root_numel)."""
    k = backward_calls
    if stage == 0:
        return {"all_gather": 0, "reduce_scatter": 0, "all_reduce": numel}
    if stage == 1:
        return {"all_gather": numel, "reduce_scatter": numel, "all_reduce": 0}
    if stage == 2:
        return {"all_gather": numel, "reduce_scatter": k * numel, "all_reduce": 0}
    if stage == 3:
        return {"all_gather": k * (2 * numel - root_numel), "reduce_scatter": k * numel, "all_reduce": 0}
    raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
