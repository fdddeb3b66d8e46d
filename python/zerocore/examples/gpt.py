"""A small GPT-style decoder language model and a tiny text data source.

The model is deliberately plain: token and position embeddings, ``n_layer``
pre-LayerNorm transformer blocks in ``GPT.blocks`` (an ``nn.ModuleList``), a
final LayerNorm and an ``lm_head`` whose weight is *tied* to the token
embedding (one parameter used twice in one forward). ``forward`` returns a
dict, ``{"logits": ..., "loss": ...}``. It exercises the model shapes the
ZeRO engine must handle: tied weights, nested modules, dict outputs.

The data is character-level text that ships with the package
(``data/tiny_corpus.txt``); :class:`TextData` cuts deterministic batches
from it, each rank taking its own slice of the global batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

CORPUS_PATH = Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"


@dataclass
class GPTConfig:
    vocab: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    seq_len: int = 64

    def __post_init__(self):
        for name in ("vocab", "n_layer", "n_head", "d_model", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{type(self).__name__}.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"{type(self).__name__}.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)).

    ``mlp`` replaces the dense :class:`MLP` (the MoE example passes its
    mixture of experts).
    """

    def __init__(self, cfg: GPTConfig, mlp: Optional[nn.Module] = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = mlp if mlp is not None else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(self.make_block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one Parameter, two uses
        self.reset_parameters(seed)

    def make_block(self, cfg: GPTConfig) -> nn.Module:
        """One transformer block; a subclass builds its own (examples/moe.py)."""
        return Block(cfg)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """GPT-2 style init, deterministic from ``seed`` (independent of the global RNG)."""
        g = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():  # named_parameters skips the tied duplicate
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith("proj.weight") else 0.02
                # Drawn on the CPU (the generator's device), also under a `with torch.device("cuda")`:
                # the same values wherever the model is built.
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32, device="cpu") * std)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> dict:
        b, t = idx.shape
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = self.run_block(block, x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return {"logits": logits, "loss": loss}

    def run_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One block's forward; a subclass may checkpoint it (examples/tp_gpt.py)."""
        return block(x)

    def num_params(self) -> int:
        """Distinct parameters (the tied weight counted once)."""
        return sum(p.numel() for p in self.parameters())


# ---------------------------------------------------------------- data


class CharTokenizer:
    """Character-level tokenizer: one id per distinct character of the text."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        try:
            return torch.tensor([self.stoi[ch] for ch in text], dtype=torch.long)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's vocabulary") from None

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def load_corpus(path: Optional[Path] = None) -> str:
    """The text that ships with the package (or ``path``)."""
    return Path(path or CORPUS_PATH).read_text(encoding="utf-8")


class TextData:
    """Deterministic (input, target) batches from a token stream.

    A *global* batch of ``global_batch`` windows of ``seq_len + 1`` tokens is
    drawn for each step from a generator seeded with (seed, step), so every
    rank draws the same global batch without communicating; rank ``r`` of
    ``world`` takes rows ``[r * B/world, (r+1) * B/world)``. Targets are the
    inputs shifted by one token.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int = 0):
        if tokens.dim() != 1 or tokens.numel() <= seq_len + 1:
            raise ValueError(
                f"need a 1-D token stream longer than seq_len + 1 = {seq_len + 1}, "
                f"got shape {tuple(tokens.shape)}"
            )
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed

    @classmethod
    def from_corpus(cls, seq_len: int, global_batch: int, seed: int = 0, path=None):
        """(data, tokenizer) over the shipped corpus."""
        text = load_corpus(path)
        tok = CharTokenizer(text)
        return cls(tok.encode(text), seq_len, global_batch, seed), tok

    def global_batch_at(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.global_batch,), generator=g)
        offsets = torch.arange(self.seq_len + 1)
        windows = self.tokens[starts[:, None] + offsets]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def batch(self, step: int, rank: int = 0, world: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of step ``step``'s global batch."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, {world})")
        if self.global_batch % world:
            raise ValueError(
                f"global batch {self.global_batch} does not split evenly over {world} ranks"
            )
        per = self.global_batch // world
        x, y = self.global_batch_at(step)
        return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]

    def batches(self, rank: int = 0, world: int = 1, start: int = 0) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """Endless iterator over this rank's batches, from step ``start``."""
        step = start
        while True:
            yield self.batch(step, rank, world)
            step += 1


def batches(rank: int = 0, world: int = 1, *, seq_len: int = 64, global_batch: int = 16, seed: int = 0, start: int = 0):
    """Shortcut: this rank's (input, target) batches over the shipped corpus."""
    data, _ = TextData.from_corpus(seq_len, global_batch, seed)
    return data.batches(rank, world, start)
