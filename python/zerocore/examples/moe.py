"""A small mixture-of-experts (MoE) GPT: :mod:`zerocore.examples.gpt`'s model
with every block's MLP replaced by a layer of experts.

Each MoE layer has a router, ``nn.Linear(d_model, n_experts)``, whose softmax
scores the experts for every token. A token goes to its ``top_k`` best
experts (1 or 2), and the layer's output for it is their outputs weighted by
those probabilities (for top-2 renormalised so the two weights sum to 1).
Each expert (gpt.py's two-layer :class:`~zerocore.examples.gpt.MLP`) runs
once, on just the tokens routed to it, and not at all when none are. So
which experts run, and which parameters get a gradient, depends on the data
and differs between data-parallel ranks: that is the model shape this example
gives the ZeRO engine. Routing has no random noise; it is a function of the
weights and the input alone.

When targets are given, the loss adds ``aux_loss_coef`` times the Switch
Transformer's load-balancing loss (Fedus et al., 2021), averaged over the
layers, which pushes the router to spread tokens evenly over the experts.

Everything else (attention, the pre-LN block, embeddings, the tied head, the
seeded init, the dict output, the data) is gpt.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerocore.examples.gpt import GPT, MLP, Block, GPTConfig


@dataclass
class MoEConfig(GPTConfig):
    n_experts: int = 4
    top_k: int = 1
    aux_loss_coef: float = 0.01

    def __post_init__(self):
        super().__post_init__()
        # The layer loops over its experts in Python: many more than 64 is not this example's size.
        if not isinstance(self.n_experts, int) or not 2 <= self.n_experts <= 64:
            raise ValueError(f"MoEConfig.n_experts must be an int from 2 to 64, got {self.n_experts!r}")
        # With at least 2 experts, top_k in {1, 2} is also never more than n_experts.
        if not isinstance(self.top_k, int) or self.top_k not in (1, 2):
            raise ValueError(f"MoEConfig.top_k must be 1 or 2, got {self.top_k!r}")
        coef = self.aux_loss_coef
        if not isinstance(coef, (int, float)) or not math.isfinite(coef) or coef < 0:
            raise ValueError(f"MoEConfig.aux_loss_coef must be a finite number >= 0, got {coef!r}")


class MoE(nn.Module):
    """Top-k routed mixture of ``n_experts`` MLPs, in place of a block's dense MLP.

    ``forward`` maps ``(..., d_model)`` to the same shape and leaves this
    call's load-balancing loss in ``self.aux_loss``: gpt.py's :class:`Block`
    passes one tensor from layer to layer, and :class:`MoEGPT` collects the
    losses from there rather than changing that interface.
    """

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.n_experts))
        self.aux_loss: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.size(-1))  # routing is per token, whatever the batch shape
        logits = self.router(tokens)
        # Router probabilities (tokens, n_experts) in fp32 at least: bf16 rounding makes the softmax
        # unstable (the Switch Transformer keeps its router in fp32 for this).
        probs = logits.softmax(dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
        gates, chosen = probs.topk(self.top_k, dim=-1)  # (tokens, top_k) each, best first
        if self.top_k == 2:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        # Top-1 keeps the raw probability as its gate: renormalised it would be 1, a constant,
        # and the router would get no gradient from the language-model loss.
        gates = gates.to(x.dtype)

        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue  # not called: no work, and its params get no gradient from this batch
            out.index_add_(0, rows, expert(tokens[rows]) * gates[rows, slot].unsqueeze(1))
        self.aux_loss = balance_loss(probs, chosen)
        return out.view_as(x)


def balance_loss(probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss, ``n_experts * sum_e f_e * P_e``.

    ``f_e`` is the fraction of the routing choices (tokens x top_k) that picked
    expert ``e`` and ``P_e`` the router's mean probability for ``e``. It is 1
    when both are uniform and ``n_experts`` when every token goes to one expert
    with certainty. ``f_e`` is a count, so the gradient flows through ``P_e``.
    """
    n_experts = probs.size(-1)
    fraction = F.one_hot(chosen.flatten(), n_experts).to(probs.dtype).mean(dim=0)
    return n_experts * (fraction * probs.mean(dim=0)).sum()


class MoEGPT(GPT):
    """gpt.py's :class:`GPT` with an :class:`MoE` layer as every block's MLP.

    Init (``reset_parameters(seed)``: every rank builds the same weights from
    the same seed; the router like any other matrix), ``num_params()`` and the
    output dict ``{"logits", "loss"}`` are GPT's; the loss adds the balancing
    term.
    """

    def make_block(self, cfg: MoEConfig) -> nn.Module:
        return Block(cfg, mlp=MoE(cfg))

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> dict:
        out = super().forward(idx, targets)
        if out["loss"] is not None:
            # The mean over layers, so the coefficient means the same at any depth.
            aux = sum(block.mlp.aux_loss for block in self.blocks) / len(self.blocks)
            out["loss"] = out["loss"] + self.cfg.aux_loss_coef * aux
        return out
