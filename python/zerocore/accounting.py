"""The paper's formulas for model-state memory and communication per step.

Notation (docs/design.md, sections 1-3): Ψ trainable parameters, N data-parallel
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
"""

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def optimizer_state_bytes(optimizer: str, dtype: str, momentum: bool = True) -> int:
    """K: bytes of optimizer state per param ("adam", "adamw" or "sgd")."""
    master = 0 if dtype == "fp32" else 4
    if optimizer in ("adam", "adamw"):
        return 8 + master
    if optimizer == "sgd":
        return (4 if momentum else 0) + master
    raise ValueError(f"unknown optimizer {optimizer!r}")


def predicted_memory(stage: int, numel: int, world_size: int, dtype: str, state_bytes: int) -> dict:
    """Bytes of model states per rank: {"param", "grad", "optim"}."""
    p, n = BYTES[dtype], world_size
    param = p * numel if stage < 3 else p * numel / n
    grad = p * numel if stage < 2 else p * numel / n
    optim = state_bytes * numel if stage == 0 else state_bytes * numel / n
    return {"param": param, "grad": grad, "optim": optim}


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
