"""The example GPT model, its data source and the main training job (dense and MoE)."""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

torch = pytest.importorskip("torch")

from zerocore.examples.gpt import CORPUS_PATH, GPT, CharTokenizer, GPTConfig, TextData, load_corpus  # noqa: E402
from zerocore.examples.moe import MoEGPT  # noqa: E402
from zerocore.examples.train import _param_groups, build_model, parse_args  # noqa: E402

TINY = dict(n_layer=2, n_head=2, d_model=32, seq_len=16)


def _model(seed=0):
    data, tok = TextData.from_corpus(seq_len=16, global_batch=8, seed=0)
    return GPT(GPTConfig(vocab=tok.vocab_size, **TINY), seed=seed), data


def test_corpus_ships_with_package():
    text = load_corpus()
    assert CORPUS_PATH.is_file() and len(text) > 4000
    tok = CharTokenizer(text)
    assert tok.decode(tok.encode(text[:200])) == text[:200]


def test_tied_weights_and_param_count():
    model, _ = _model()
    assert model.lm_head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names  # counted once
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == TINY["n_layer"]
    # one gradient, from both uses
    x = torch.randint(0, model.cfg.vocab, (2, 8))
    model(x, x)["loss"].backward()
    assert model.tok_emb.weight.grad is not None and model.lm_head.weight.grad is model.tok_emb.weight.grad


def test_deterministic_init_and_dict_output():
    a, data = _model(seed=1)
    b, _ = _model(seed=1)
    c, _ = _model(seed=2)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
    assert not torch.equal(a.blocks[0].attn.qkv.weight, c.blocks[0].attn.qkv.weight)
    x, y = data.batch(0)
    out = a(x, y)
    assert set(out) == {"logits", "loss"} and out["logits"].shape == (*x.shape, a.cfg.vocab)
    assert a(x)["loss"] is None


def test_loss_decreases():
    torch.manual_seed(0)
    model, data = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(12):
        x, y = data.batch(step)
        loss = model(x, y)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses


def test_rank_slices_are_disjoint_and_deterministic():
    data, _ = TextData.from_corpus(seq_len=16, global_batch=8, seed=3)
    gx, gy = data.global_batch_at(5)
    assert torch.equal(gx[:, 1:], gy[:, :-1])  # targets are inputs shifted by one
    parts = [data.batch(5, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), gx)
    assert torch.equal(torch.cat([p[1] for p in parts]), gy)
    for i in range(4):
        assert parts[i][0].shape == (2, 16)
        for j in range(i + 1, 4):
            assert not torch.equal(parts[i][0], parts[j][0])
    again = TextData.from_corpus(seq_len=16, global_batch=8, seed=3)[0].batch(5, 2, 4)
    assert torch.equal(again[0], parts[2][0])
    assert not torch.equal(data.batch(6, 2, 4)[0], parts[2][0])  # a new step, new data
    with pytest.raises(ValueError, match="split evenly"):
        data.batch(0, 0, 3)
    it = data.batches(rank=1, world=2)
    assert torch.equal(next(it)[0], data.batch(0, 1, 2)[0])
    assert torch.equal(next(it)[0], data.batch(1, 1, 2)[0])


def _has_engine():
    import zerocore

    return hasattr(zerocore, "wrap")


RUN_FLAGS = ["--steps", "3", "--ranks", "2", "--timeout", "60"]


def _run_train(flags):
    """The train job's output and its per-step losses (--losses-out, full
    precision), run as a user runs it; the job must succeed and print the
    same losses to 4 decimals."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "losses.json")
        cmd = [sys.executable, "-m", "zerocore.examples.train", *flags, "--losses-out", path]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(path) as f:
            losses = json.load(f)
    printed = [float(x) for x in re.findall(r"^step +\d+/\d+ +loss (\S+)", proc.stdout, re.M)]
    assert len(losses) == parse_args(flags).steps and printed == pytest.approx(losses, abs=5.1e-5)
    return proc.stdout, losses


def _torch_reference(args):
    """The job's losses from single-process torch in float64: its model (the
    dense GPT for --tp, which computes the same function) and AdamW on the
    same global batches, each step's loss the mean of the data-parallel
    ranks' losses on their slices (MoE's balancing term is per rank). Also,
    for MoE, the (block, expert) pairs each rank ran in each step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matmuls: 25x faster than 2 threads on a busy 2-core machine
    try:
        return _train_reference(args)
    finally:
        torch.set_num_threads(threads)


def _train_reference(args):
    dp_world = args.ranks // args.tp
    data, tok = TextData.from_corpus(args.seq_len, args.batch, seed=args.seed)
    model = build_model(argparse.Namespace(**dict(vars(args), tp=1, checkpoint="none")), tok.vocab_size).double()
    opt = torch.optim.AdamW(_param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    ran = set()
    for b, block in enumerate(model.blocks):
        for e, expert in enumerate(getattr(block.mlp, "experts", ())):
            expert.register_forward_hook(lambda *_, key=(b, e): ran.add(key))
    losses, experts_run = [], []
    for step in range(args.steps):
        loss, per_rank = 0.0, []
        for rank in range(dp_world):
            for micro in range(args.accum):
                ran.clear()
                x, y = data.batch(step * args.accum + micro, rank, dp_world)
                loss = loss + model(x, y)["loss"] / (dp_world * args.accum)
                per_rank.append(frozenset(ran))
        experts_run.append(per_rank)
        loss.backward()
        for p in model.parameters():  # the engine counts a param no rank gave a grad as a zero grad
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, experts_run


# fp32 runs against the float64 reference: measured within 2e-7 (fp32 rounding); the losses move
# by 1e-2 to 4e-1 a step.
FP32_ABS = 1e-5


@pytest.mark.skipif(not _has_engine(), reason="zerocore.wrap (the engine) is not built yet")
def test_train_job_runs():
    out, losses = _run_train(RUN_FLAGS)
    assert "step    3/3" in out
    assert "model-state memory per rank" in out and "communication in one optimizer step" in out
    # It says what it trains on, what loss means, and what every symbol and column is.
    assert "tiny_corpus.txt" in out and "ln(" in out and "uniform guess" in out
    for symbol in ("Ψ = trainable params", "N = data-parallel ranks", "K = bytes of optimizer state",
                   "comm_buffers  ", "plain DP  ", "formula  ", "Elements (not bytes)"):
        assert symbol in out, symbol
    assert "DESIGN.md" not in out and "../shared" not in out  # the docs it names ship with the repo
    named = re.findall(r"docs/[\w.-]+\.md", out)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert named and all(os.path.isfile(os.path.join(repo, doc)) for doc in named), named
    # What ZeRO saved: stage 3 on 2 ranks holds half of plain data parallelism's model states.
    saved = [line for line in out.splitlines() if line.strip().startswith("saved by ZeRO")]
    assert saved and "2.00x less" in saved[0], saved
    # What it trained: the default job computes in bf16 (fp32 master weights), measured within 4e-4
    # of float64 torch over these steps (at 1 to 4 ranks, stages 1 to 3). The loss falls by 0.44,
    # then 0.11; a learning rate 5% off moves the third loss by 3.3e-3.
    assert losses == pytest.approx(_torch_reference(parse_args(RUN_FLAGS))[0], abs=1.5e-3)


# Few tokens per rank (2 sequences x 8) over 8 experts: each rank leaves some experts idle.
MOE_FLAGS = RUN_FLAGS + ["--model", "moe", "--dtype", "fp32", "--experts", "8", "--layers", "2",
                         "--heads", "2", "--d-model", "32", "--seq-len", "8", "--batch", "4"]


@pytest.mark.skipif(not _has_engine(), reason="zerocore.wrap (the engine) is not built yet")
@pytest.mark.parametrize("stage", [2, 3])  # stage 3: each expert is a unit, gathered only where ranks agree
def test_train_job_runs_moe(stage):
    flags = MOE_FLAGS + ["--stage", str(stage)]
    ref, experts_run = _torch_reference(parse_args(flags))
    # The case this run is for: in some step the two ranks ran different experts.
    assert any(len(set(per_rank)) > 1 for per_rank in experts_run), experts_run

    out, losses = _run_train(flags)
    assert "model:  MoE GPT (8 experts, top-1), 2 blocks" in out
    assert losses == pytest.approx(ref, abs=FP32_ABS)


TP_FLAGS = ["--steps", "3", "--timeout", "60", "--dtype", "fp32", "--layers", "2", "--heads", "2", "--d-model",
            "32", "--seq-len", "8", "--batch", "4"]


@pytest.mark.skipif(not _has_engine(), reason="zerocore.wrap (the engine) is not built yet")
def test_train_job_runs_tensor_parallel_with_partitioned_checkpoints():
    flags = TP_FLAGS + ["--ranks", "4", "--tp", "2", "--offload"]
    out, losses = _run_train(flags)
    assert "tensor-parallel GPT (TP=2 x DP=2), blocks checkpointed with zerocore (offload to the host)" in out
    rows = re.findall(r"^ +(\d) +([\d,]+) +([\d,]+) +([\d.]+) +([\d,]+)$", out, re.M)
    assert [r[0] for r in rows] == ["0", "1", "2", "3"], out[-2000:]
    for _, kept, whole, ratio, buffer in rows:
        # The buffers: the contiguous one on the host (what the 2 blocks keep at once) and the
        # device ones backward copies both back to, as large (the forward packed in one of them).
        kept, whole, buffer = (int(n.replace(",", "")) for n in (kept, whole, buffer))
        assert ratio == "0.5000" and buffer == 2 * kept and whole > 0
    # The dense model trained by one process on the same global batches: the same losses.
    assert losses == pytest.approx(_torch_reference(parse_args(flags))[0], abs=FP32_ABS)


@pytest.mark.skipif(not _has_engine(), reason="zerocore.wrap (the engine) is not built yet")
def test_train_job_runs_with_the_optimizer_offloaded():
    flags = TP_FLAGS + ["--ranks", "2", "--stage", "2"]
    losses = [_run_train(flags + extra)[1] for extra in ([], ["--offload-optimizer"])]
    assert losses[0] == losses[1]  # the host step gives the device step's bits
    assert losses[0] == pytest.approx(_torch_reference(parse_args(flags))[0], abs=FP32_ABS)
    out, _ = _run_train(flags + ["--offload-optimizer", "--delayed-update", "1"])
    assert "step    3/3" in out and "offloaded (ZeRO-Offload)" in out
    assert re.search(r"rank 1: device [\d,]+, host [\d,]+; grads to host [\d,]+, params to device [\d,]+", out)


def test_train_job_help_shows_each_default_once():
    from zerocore.examples.train import _HelpFormatter, build_parser

    parser = build_parser()
    assert "None" not in parser.format_help()
    fmt = _HelpFormatter(parser.prog)
    for action in parser._actions:
        if action.option_strings and action.nargs != 0:  # every flag that takes a value
            assert fmt._expand_help(action).count("default") == 1, action.option_strings


def test_train_job_rejects_bad_flags(capsys):
    for argv, msg in ((["--d-model", "30", "--heads", "4"], "divisible"), (["--steps", "0"], "--steps"),
                      (["--loss-scale", "big"], "loss-scale"), (["--stage", "4"], "invalid choice"),
                      (["--experts", "1"], "--experts"), (["--experts", "65"], "--experts"),
                      (["--top-k", "3"], "invalid choice"), (["--model", "dense"], "invalid choice"),
                      (["--tp", "3"], "--tp"), (["--model", "moe", "--tp", "2"], "--model gpt only")):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code != 0 and msg in capsys.readouterr().err


def test_train_job_model_flag_chooses_the_model():
    moe = build_model(parse_args(["--model", "moe", "--experts", "3", "--top-k", "2", "--layers", "1"]), 40)
    assert isinstance(moe, MoEGPT) and (moe.cfg.n_experts, moe.cfg.top_k, moe.cfg.vocab) == (3, 2, 40)
    assert len(moe.blocks) == 1 and len(moe.blocks[0].mlp.experts) == 3
    assert type(build_model(parse_args(["--layers", "1"]), 40)) is GPT
