"""Small models for the engine tests, each exercising a shape real models have."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, SEQ, DIM = 32, 8, 16


class Block(nn.Module):
    def __init__(self, dim=DIM):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, a ModuleList of blocks (stage 3 units), head tied to the
    embedding when `tied`."""

    def __init__(self, layers=2, tied=True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


class LateGrads(TinyLM):
    """The head's weight serves the head and, again, inside each block's
    reentrant checkpoint: the head's grad reaches the reducer first, and
    once its buckets are reduced the recomputation's backward sends a second
    one, late (stages 2-3's late-grad agreement, in the step's exchange)."""

    def __init__(self):
        super().__init__(layers=2, tied=False)

    def _block(self, b, h):
        return b(h) + 0.1 * torch.tanh(h @ self.head.weight.t()) @ self.head.weight

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.blocks:
            x = checkpoint(self._block, b, x, use_reentrant=True)
        return self.head(self.norm(x))


def make(cls=TinyLM, seed=0, **kw):
    torch.manual_seed(seed)
    return cls(**kw)


def lm_batch(step, micro, world, per_rank=2):
    """The global batch of (step, micro): inputs and targets."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    idx = torch.randint(0, VOCAB, (per_rank * world, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def lm_loss(logits, targets):
    """Cross entropy in fp32 for 16-bit logits, in the logits' own dtype
    otherwise (a float64 reference stays float64)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def local(t, rank, world):
    return t.chunk(world)[rank]


def reference_train(model, opt, steps, accum, world, batch=lm_batch, loss_fn=lm_loss, forward=None,
                    zero_unused=True, scheduler=None, losses=None):
    """Single-process training on the global batch: the reference every
    engine run is compared with. Params that got no grad are given a zero
    grad, as the flat-buffer optimizers treat them. Each micro-batch's loss
    is appended to `losses` when given."""
    forward = forward or (lambda m, x, step: m(x))
    for step in range(steps):
        for micro in range(accum):
            x, y = batch(step, micro, world)
            loss = loss_fn(forward(model, x, step), y)
            loss.backward()
            if losses is not None:
                losses.append(loss.item())
        if zero_unused:
            for p in model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_train(engine, rank, world, steps, accum, batch=lm_batch, loss_fn=lm_loss, forward=None,
                 scheduler=None, losses=None):
    """reference_train's steps on this rank's part of each batch."""
    forward = forward or (lambda e, x, step: e(x))
    for step in range(steps):
        for micro in range(accum):
            x, y = batch(step, micro, world)
            loss = loss_fn(forward(engine, local(x, rank, world), step), local(y, rank, world))
            engine.backward(loss)
            if losses is not None:
                losses.append(loss.item())
        engine.step()
        engine.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return engine.full_state_dict()


def assert_state_close(got, ref, rtol, atol, what=""):
    assert set(got) == set(ref), f"{what}: keys differ: {set(got) ^ set(ref)}"
    for k in ref:
        torch.testing.assert_close(got[k].float(), ref[k].float(), rtol=rtol, atol=atol, msg=lambda m: f"{what} {k}: {m}")
