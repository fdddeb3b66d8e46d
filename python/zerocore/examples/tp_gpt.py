"""A Megatron-style tensor-parallel GPT: :mod:`zerocore.examples.gpt`'s model
with every block's attention and MLP split over a process group.

Within a block, the first linear of the attention (the fused ``qkv``) and of
the MLP (``fc``) is column-parallel: each rank of the tensor-parallel group
holds the rows of its share of the heads (of the hidden units), so it
computes its share of the outputs from the whole input. The second linear
(``proj``) is row-parallel: each rank holds the columns that match, computes
a partial output, and an all-reduce sums them (Megatron's "g"); the input of
a column-parallel linear all-reduces its gradient in backward instead
(Megatron's "f"). Everything else (LayerNorms, embeddings, the tied head,
the residual stream and its dropout) is replicated: every rank of the group
computes the same values, which is why every rank would hold the same
activation checkpoint, and what ``zerocore.checkpoint(..., group=)``
partitions.

The model is built as :class:`~zerocore.examples.gpt.GPT` with the same seed
and then cut: at tensor-parallel degree 1 it computes what GPT computes, and
at any degree the same function (up to the order of floating-point sums).
``checkpointing`` chooses what each block keeps for backward: ``"none"``
(all its activations), ``"torch"`` (torch.utils.checkpoint) or
``"zerocore"`` (zerocore.checkpoint, partitioned over the group, with
``offload`` and ``contiguous``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from zerocore.examples.gpt import GPT, Block, GPTConfig

CHECKPOINTING = ("none", "torch", "zerocore")


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward sums the partial outputs over the group; identity backward (g)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnParallelLinear(nn.Module):
    """This rank's rows of ``dense`` (of each of its ``parts`` stacked
    matrices: 3 for a fused q, k, v): its share of the outputs."""

    def __init__(self, dense: nn.Linear, group, parts: int = 1):
        super().__init__()
        self.group = group
        world, rank = _world(group), _rank(group)

        def rows(t):
            blocks = t.detach().reshape(parts, -1, *t.shape[1:]).chunk(world, dim=1)[rank]
            return nn.Parameter(blocks.reshape(-1, *t.shape[1:]).clone())

        self.weight, self.bias = rows(dense.weight), rows(dense.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            x = _CopyToGroup.apply(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's columns of ``dense``: a partial output from its share of
    the inputs, summed over the group; the bias is added once, after."""

    def __init__(self, dense: nn.Linear, group):
        super().__init__()
        self.group = group
        columns = dense.weight.detach().chunk(_world(group), dim=1)[_rank(group)]
        self.weight = nn.Parameter(columns.clone())
        self.bias = nn.Parameter(dense.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.group is not None:
            partial = _ReduceFromGroup.apply(partial, self.group)
        return partial + self.bias


class TPAttention(nn.Module):
    def __init__(self, dense, n_head: int, group):
        super().__init__()
        self.n_head = n_head // _world(group)  # this rank's heads
        self.qkv = ColumnParallelLinear(dense.qkv, group, parts=3)
        self.proj = RowParallelLinear(dense.proj, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)
        width = q.shape[-1]
        q, k, v = (z.view(b, t, self.n_head, width // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, width))


class TPMLP(nn.Module):
    def __init__(self, dense, group):
        super().__init__()
        self.fc = ColumnParallelLinear(dense.fc, group)
        self.proj = RowParallelLinear(dense.proj, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class TPBlock(nn.Module):
    """gpt.py's pre-LN block, cut over ``group``, with dropout on both
    residual branches (replicated: the same on every rank of the group,
    whose RNGs are seeded alike)."""

    def __init__(self, dense: Block, cfg: GPTConfig, group, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = dense.ln1, dense.ln2
        self.attn = TPAttention(dense.attn, cfg.n_head, group)
        self.mlp = TPMLP(dense.mlp, group)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TPGPT(GPT):
    """GPT with tensor-parallel blocks over ``group`` (None: one rank), each
    block checkpointed as ``checkpointing`` says."""

    def __init__(self, cfg: GPTConfig, group=None, seed: int = 0, checkpointing: str = "none",
                 offload: Optional[str] = None, contiguous: bool = True, dropout: float = 0.0):
        world = _world(group)
        if cfg.n_head % world:
            raise ValueError(f"n_head ({cfg.n_head}) must be divisible by the tensor-parallel degree ({world})")
        if checkpointing not in CHECKPOINTING:
            raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {checkpointing!r}")
        super().__init__(cfg, seed)  # the dense model, initialised as gpt.GPT, then cut
        self.group, self.checkpointing, self.offload, self.contiguous = group, checkpointing, offload, contiguous
        self.blocks = nn.ModuleList(TPBlock(b, cfg, group, dropout) for b in self.blocks)

    def run_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing == "zerocore":
            import zerocore

            return zerocore.checkpoint(block, x, group=self.group, offload=self.offload, contiguous=self.contiguous)
        if self.checkpointing == "torch":
            return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return block(x)


def tp_groups(tp: int):
    """(tensor-parallel group, data-parallel group) of this rank, the world
    cut into consecutive blocks of ``tp`` ranks (rank = dp_index * tp +
    tp_index); every rank makes every group, in the same order, as
    torch.distributed.new_group needs."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise ValueError(f"the world ({world} ranks) does not split into tensor-parallel groups of {tp}")
    mine = {}
    for start in range(0, world, tp):
        ranks = list(range(start, start + tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["tp"] = group
    for offset in range(tp):
        ranks = list(range(offset, world, tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["dp"] = group
    return mine["tp"], mine["dp"]
