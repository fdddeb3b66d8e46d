"""The mixture-of-experts example model (zerocore.examples.moe), against a
token-by-token float64 reference; its end-to-end training run is in
test_examples.py, beside the dense model's."""

import math

import pytest

torch = pytest.importorskip("torch")

from zerocore.examples.gpt import GPT, GPTConfig, TextData  # noqa: E402
from zerocore.examples.moe import MoE, MoEConfig, MoEGPT  # noqa: E402

TINY = dict(vocab=40, n_layer=2, n_head=2, d_model=16, seq_len=12)


def _layer(gen, **cfg):
    """An MoE layer with random weights from ``gen``, large enough that the
    router's choices differ clearly from token to token."""
    layer = MoE(MoEConfig(**TINY, **cfg))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return layer


def _gelu_tanh(h):
    return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))


def _reference(layer, x, top_k):
    """The layer's output, token by token in float64 from its weights: the
    router's softmax; the top_k experts by probability; each expert's
    Linear-GELU-Linear written out, weighted by its probability (for top-2
    divided by the two probabilities' sum)."""
    w = {name: p.detach().double() for name, p in layer.named_parameters()}
    n_experts = w["router.bias"].numel()
    rows = []
    for token in x.detach().double().reshape(-1, x.shape[-1]):
        prob = torch.softmax(w["router.weight"] @ token + w["router.bias"], dim=0).tolist()
        best = sorted(range(n_experts), key=lambda e: -prob[e])[:top_k]
        total = sum(prob[e] for e in best) if top_k == 2 else 1.0
        y = torch.zeros_like(token)
        for e in best:
            hidden = _gelu_tanh(w[f"experts.{e}.fc.weight"] @ token + w[f"experts.{e}.fc.bias"])
            y += prob[e] / total * (w[f"experts.{e}.proj.weight"] @ hidden + w[f"experts.{e}.proj.bias"])
        rows.append(y)
    return torch.stack(rows).reshape(x.shape)


@pytest.mark.parametrize("top_k", [1, 2])
def test_layer_matches_per_token_reference(gen, top_k):
    layer = _layer(gen, n_experts=4, top_k=top_k).double()  # float64: no near-ties decided by rounding
    x = torch.randn(3, 10, TINY["d_model"], generator=gen, dtype=torch.float64)
    torch.testing.assert_close(layer(x), _reference(layer, x, top_k), rtol=1e-10, atol=1e-10)


def test_top2_gates_sum_to_one(gen):
    # With every expert the same function f, whichever two a token picks, the output is
    # (w1 + w2) * f(x): f(x) exactly when the two weights sum to 1. Top-1 instead keeps
    # the chosen expert's raw probability (so the router gets a gradient).
    for top_k in (1, 2):
        layer = _layer(gen, n_experts=4, top_k=top_k).double()
        with torch.no_grad():
            for expert in layer.experts[1:]:
                expert.load_state_dict(layer.experts[0].state_dict())
        x = torch.randn(20, TINY["d_model"], generator=gen, dtype=torch.float64)
        f = layer.experts[0](x)
        gate = 1.0 if top_k == 2 else layer.router(x).softmax(-1).max(-1, keepdim=True).values
        torch.testing.assert_close(layer(x), gate * f, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("top_k", [1, 2])
def test_unrouted_expert_is_not_called(gen, top_k):
    layer = _layer(gen, n_experts=4, top_k=top_k)
    with torch.no_grad():
        layer.router.bias[2] = -1e4  # its probability underflows to 0: no token picks it
    rows_seen = {e: [] for e in range(4)}
    for e, expert in enumerate(layer.experts):
        expert.register_forward_hook(lambda mod, args, out, e=e: rows_seen[e].append(args[0].shape[0]))
    x = torch.randn(4, 12, TINY["d_model"], generator=gen)
    layer(x).sum().backward()

    assert rows_seen[2] == []
    for e in (0, 1, 3):  # the others: one call each, on their share of the tokens
        assert len(rows_seen[e]) == 1 and 0 < rows_seen[e][0] < x.shape[0] * x.shape[1], rows_seen
    assert sum(n for calls in rows_seen.values() for n in calls) == x.shape[0] * x.shape[1] * top_k
    # No call, no gradient: on a data-parallel rank this expert's grads stay None.
    assert all(p.grad is None for p in layer.experts[2].parameters())
    assert all(p.grad is not None for e in (0, 1, 3) for p in layer.experts[e].parameters())
    assert layer.router.weight.grad is not None


def test_balance_loss_matches_counts(gen):
    n_experts = 5
    for top_k in (1, 2):
        layer = _layer(gen, n_experts=n_experts, top_k=top_k)
        x = torch.randn(30, TINY["d_model"], generator=gen)
        layer(x)
        probs = layer.router(x).double().softmax(-1)
        picks = [0] * n_experts
        for row in probs.tolist():
            for e in sorted(range(n_experts), key=lambda e: -row[e])[:top_k]:
                picks[e] += 1
        expected = n_experts * sum(picks[e] / (30 * top_k) * probs[:, e].mean().item() for e in range(n_experts))
        assert layer.aux_loss.item() == pytest.approx(expected, rel=1e-5)


def test_model_adds_balance_loss_and_builds_like_gpt():
    data, tok = TextData.from_corpus(seq_len=12, global_batch=4, seed=0)
    cfg = dict(TINY, vocab=tok.vocab_size)
    a = MoEGPT(MoEConfig(**cfg, n_experts=3, aux_loss_coef=0.5), seed=1)
    b = MoEGPT(MoEConfig(**cfg, n_experts=3, aux_loss_coef=0.5), seed=1)
    c = MoEGPT(MoEConfig(**cfg, n_experts=3, aux_loss_coef=0.5), seed=2)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n  # every rank builds the same weights from the same seed
    assert not torch.equal(a.blocks[0].mlp.router.weight, c.blocks[0].mlp.router.weight)
    assert a.lm_head.weight is a.tok_emb.weight
    assert isinstance(a.blocks, torch.nn.ModuleList) and len(a.blocks) == TINY["n_layer"]

    # The dense GPT's params, plus per block 2 more MLPs and the router.
    d = TINY["d_model"]
    mlp = d * 4 * d + 4 * d + 4 * d * d + d
    dense = GPT(GPTConfig(**cfg)).num_params()
    assert a.num_params() == dense + TINY["n_layer"] * (2 * mlp + d * 3 + 3)

    x, y = data.batch(0)
    out = a(x, y)
    assert set(out) == {"logits", "loss"} and a(x)["loss"] is None
    ce = torch.nn.functional.cross_entropy(out["logits"].view(-1, tok.vocab_size), y.reshape(-1))
    aux = [block.mlp.aux_loss.item() for block in a.blocks]
    assert out["loss"].item() == pytest.approx(ce.item() + 0.5 * sum(aux) / len(aux), rel=1e-6)


@pytest.mark.parametrize("field, value", [
    ("n_experts", 1), ("n_experts", 65), ("n_experts", 2.5), ("top_k", 0), ("top_k", 3),
    ("aux_loss_coef", -0.1), ("aux_loss_coef", float("nan")), ("vocab", 0), ("d_model", 15),
])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"MoEConfig.{field}"):
        MoEConfig(**dict(TINY, **{field: value}))

