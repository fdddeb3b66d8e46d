"""Train a small GPT-style model with ZeRO on CPU ranks (gloo).

    python -m zerocore.examples.train                 # stage 3, 2 ranks, bf16
    python -m zerocore.examples.train --stage 1 --ranks 4 --dtype fp32 --steps 50
    python -m zerocore.examples.train --model moe     # mixture of experts, 4 experts, top-1
    python -m zerocore.examples.train --tp 2 --ranks 4  # tensor parallel x ZeRO, partitioned checkpoints
    torchrun --nproc-per-node 2 -m zerocore.examples.train --stage 2

It trains a character-level GPT (``--model gpt``, zerocore.examples.gpt)
or its mixture-of-experts variant (``--model moe``, zerocore.examples.moe,
where each rank runs only the experts its tokens are routed to) on the
corpus bundled with the package (``zerocore/examples/data/tiny_corpus.txt``,
a short story), so it needs no download. With ``--ranks N`` the job starts
N local processes itself (gloo over 127.0.0.1, meeting through a file in a
fresh temporary folder, so no port can be taken by another job between
choosing and binding it); under torchrun
(RANK/WORLD_SIZE set) it uses the launcher's environment instead. Rank 0
prints the loss, tokens/s and time of every step (tokens of the global
batch, all ranks together), and after the last the run's throughput in one
line (``throughput:``, the first step left out as warm-up). At the end
every rank's measured model-state memory (``engine.memory_report()``) is
printed beside the ZeRO formula (``zerocore.sizing.accounting.predicted_memory``,
docs/formulas.md) and beside what plain data parallelism would hold, and the
elements moved by each kind of collective in one step
(``engine.comm_stats()``) beside ``zerocore.sizing.accounting.predicted_comm``.
With ``--tp T`` the GPT's blocks are tensor-parallel
(zerocore.examples.tp_gpt) over groups of T consecutive ranks and ZeRO
partitions over the other dimension (--ranks / T ranks), each block
checkpointed with ``zerocore.checkpoint`` partitioned over its
tensor-parallel group (``--checkpoint``, ``--offload``); the report then
adds every rank's activation-checkpoint bytes beside what the same
checkpoints take whole.

The job exits non-zero with a message on any failure; every collective and
the rendezvous have a timeout (``--timeout``), so no rank waits forever.

One file on purpose, longer than the library's modules: it is the README's
main job, which a user reads top to bottom and copies from (its flags,
their launch, the loop, the report) without following imports.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pickle
import sys
import tempfile
import time
import traceback
from datetime import timedelta

DTYPES = ("fp32", "bf16", "fp16")


class JobError(RuntimeError):
    """A failure with a message meant for the user (no traceback needed)."""


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default once. Flags whose default is decided at run
    time (None: the engine's own, or one derived from the machine) say so in
    their help instead of printing "(default: None)"."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and not any(action.default is x for x in (None, False, argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


def _engine_default(field: str) -> str:
    from zerocore.config import Config

    return f"{Config.__dataclass_fields__[field].default:,}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zerocore.examples.train",
        description="Train a small character-level GPT (dense or mixture-of-experts) on the bundled corpus "
                    "with zerocore's ZeRO stages on CPU ranks (gloo), then report per-rank memory and "
                    "communication beside the ZeRO formulas (docs/formulas.md).",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3),
                   help="ZeRO stage: 0 plain data parallel, 1 +optimizer states partitioned, 2 +gradients, "
                        "3 +parameters")
    p.add_argument("--ranks", type=int, default=2, help="local processes to start (ignored under torchrun)")
    p.add_argument("--dtype", default="bf16", choices=DTYPES,
                   help="training dtype of params, activations and grads (fp32 master weights for bf16/fp16)")
    p.add_argument("--reduce-dtype", default=None, choices=DTYPES,
                   help="dtype of gradient reduction (default: --dtype)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--accum", type=int, default=1, help="backward calls (micro-batches) per optimizer step")
    p.add_argument("--batch", type=int, default=8, help="global micro-batch size in sequences (split over ranks)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens (characters) per sequence")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--d-model", type=int, default=128, help="model width")
    p.add_argument("--model", default="gpt", choices=("gpt", "moe"),
                   help="gpt: dense MLPs; moe: a routed mixture of experts in place of each block's MLP")
    p.add_argument("--experts", type=int, default=4, help="--model moe: experts per block, 2 to 64")
    p.add_argument("--top-k", type=int, default=1, choices=(1, 2),
                   help="--model moe: experts each token is routed to")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: --model gpt's blocks split Megatron-style over groups of this many "
                        "ranks, ZeRO over the rest (--ranks / --tp)")
    p.add_argument("--checkpoint", default=None, choices=("none", "torch", "zerocore"),
                   help="activation checkpointing of each block: none, torch.utils.checkpoint, or zerocore.checkpoint "
                        "partitioned over the tensor-parallel group (default: zerocore with --tp > 1, else none)")
    p.add_argument("--offload", action="store_true",
                   help="--checkpoint zerocore: keep the checkpoints' partitions in host memory (offload='cpu')")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="ZeRO-Offload: fp32 master params, AdamW state and the step on the host "
                        "(offload_optimizer='cpu'; stages 1-3)")
    p.add_argument("--offload-params", action="store_true",
                   help="stage 3 with --offload-optimizer: the param shards on the host too")
    p.add_argument("--delayed-update", type=int, default=None, metavar="WARMUP",
                   help="with --offload-optimizer: the one-step delayed parameter update after WARMUP steps "
                        "(default: no delayed update)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    p.add_argument("--max-grad-norm", type=float, default=None,
                   help="clip gradients to this global norm (default: no clipping)")
    p.add_argument("--bucket-bytes", type=int, default=None,
                   help=f"size of the constant-size communication buckets (default: the engine's, "
                        f"{_engine_default('bucket_bytes')})")
    p.add_argument("--prefetch-bytes", type=int, default=None,
                   help=f"stage 3: bytes of upcoming units gathered ahead of use (default: the engine's, "
                        f"{_engine_default('prefetch_bytes')})")
    p.add_argument("--persist-threshold", type=int, default=None,
                   help=f"stage 3: params with fewer elements stay whole on every rank (default: the "
                        f"engine's, {_engine_default('persist_threshold')}, which partitions all, so memory "
                        f"and communication match the formulas exactly)")
    p.add_argument("--loss-scale", default=None,
                   help='fp16 loss scale: "dynamic" or a number (default: dynamic for fp16, none otherwise)')
    p.add_argument("--seed", type=int, default=0, help="seed of the model's initialisation and the data order")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per rank (default: CPU cores / local ranks)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a stuck rendezvous/collective fails")
    p.add_argument("--start-method", default=None, choices=("fork", "spawn", "forkserver"),
                   help="how --ranks processes start (default: fork on Linux, spawn elsewhere)")
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    p.add_argument("--losses-out", default=None, metavar="FILE",
                   help="also write every step's loss (mean over ranks, full precision) to FILE as a JSON list "
                        "(default: not written)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("ranks", "steps", "accum", "batch", "seq_len", "layers", "heads", "d_model"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be divisible by --heads ({args.heads})")
    if not 2 <= args.experts <= 64:
        p.error(f"--experts must be from 2 to 64, got {args.experts}")
    if args.tp < 1 or args.ranks % args.tp or args.heads % args.tp:
        p.error(f"--tp ({args.tp}) must be >= 1 and divide --ranks ({args.ranks}) and --heads ({args.heads})")
    if args.checkpoint is None:
        args.checkpoint = "zerocore" if args.tp > 1 else "none"
    if args.model != "gpt" and (args.tp > 1 or args.checkpoint != "none"):
        p.error("--tp and --checkpoint work with --model gpt only")
    if args.loss_scale is not None and args.loss_scale != "dynamic":
        try:
            args.loss_scale = float(args.loss_scale)
        except ValueError:
            p.error(f'--loss-scale must be "dynamic" or a number, got {args.loss_scale!r}')
    return args


# ------------------------------------------------------------------ helpers


@contextlib.contextmanager
def _rendezvous():
    """An init_method for ranks on this machine: a file in a fresh
    temporary folder, removed when the job ends."""
    with tempfile.TemporaryDirectory(prefix="zerocore-train-") as folder:
        yield f"file://{os.path.join(folder, 'rendezvous')}"


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not x.is_integer():
        return f"{x:,.1f}"
    return f"{int(x):,}"


def _ratio(measured, predicted) -> str:
    if predicted is None or measured is None:
        return "-"
    if predicted == 0:
        return "exact" if measured == 0 else "n/a"
    return f"{measured / predicted:.4f}"


def _engine_config(args) -> dict:
    cfg = {"stage": args.stage, "dtype": args.dtype}
    optional = {
        "reduce_dtype": args.reduce_dtype,
        "bucket_bytes": args.bucket_bytes,
        "prefetch_bytes": args.prefetch_bytes,
        "persist_threshold": args.persist_threshold,
        "max_grad_norm": args.max_grad_norm,
        "loss_scale": args.loss_scale,
    }
    cfg.update({k: v for k, v in optional.items() if v is not None})
    if args.offload_optimizer:
        cfg["offload_optimizer"] = "cpu"
    if args.offload_params:
        cfg["offload_params"] = "cpu"
    if args.delayed_update is not None:
        cfg.update(delayed_update=True, delayed_update_warmup=args.delayed_update)
    return cfg


def build_model(args, vocab: int, tp_group=None):
    """The model --model names, initialised from --seed (the same on every
    rank); tensor-parallel over tp_group with --tp, checkpointed as
    --checkpoint says."""
    from zerocore.examples.gpt import GPT, GPTConfig
    from zerocore.examples.moe import MoEConfig, MoEGPT
    from zerocore.examples.tp_gpt import TPGPT

    shape = dict(vocab=vocab, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                 seq_len=args.seq_len)
    if args.model == "moe":
        return MoEGPT(MoEConfig(**shape, n_experts=args.experts, top_k=args.top_k), seed=args.seed)
    if args.tp > 1 or args.checkpoint != "none":
        return TPGPT(GPTConfig(**shape), tp_group, seed=args.seed, checkpointing=args.checkpoint,
                     offload="cpu" if args.offload else None)
    return GPT(GPTConfig(**shape), seed=args.seed)


def default_model():
    """The model the job trains with its default flags, built from nothing
    else: `zerocore estimate zerocore.examples.train:default_model --ranks 2`
    tells its memory per rank."""
    from zerocore.examples.gpt import CharTokenizer, load_corpus

    return build_model(parse_args([]), CharTokenizer(load_corpus()).vocab_size)


def _param_groups(model, weight_decay: float):
    """Weight decay on matrices only (embeddings and linear weights), none on biases and LayerNorms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# ------------------------------------------------------------------ one rank


def train(args, rank: int, world: int) -> dict:
    """Run the job on this rank (process group already initialised). Returns this rank's summary."""
    import torch
    import torch.distributed as dist

    import zerocore
    from zerocore.sizing import accounting
    from zerocore.examples.gpt import CORPUS_PATH, TextData

    from zerocore.examples.tp_gpt import tp_groups

    data, tok = TextData.from_corpus(args.seq_len, args.batch, seed=args.seed)
    tp_group, dp_group = tp_groups(args.tp) if args.tp > 1 else (None, None)
    dp_rank, dp_world = (dist.get_rank(dp_group), dist.get_world_size(dp_group)) if dp_group else (rank, world)
    if args.batch % dp_world:
        raise JobError(f"--batch {args.batch} does not split evenly over {dp_world} data-parallel ranks")
    model = build_model(args, tok.vocab_size, tp_group)
    opt = torch.optim.AdamW(_param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    engine_cfg = _engine_config(args)
    engine = zerocore.wrap(model, opt, zerocore.Config(**engine_cfg), group=dp_group)
    numel = int(engine.num_trainable_params)

    say = (lambda *a: print(*a, flush=True)) if rank == 0 and not args.quiet else (lambda *a: None)
    say(banner(args, world, CORPUS_PATH.name, data.tokens.numel(), tok.vocab_size, numel, engine_cfg,
               torch.get_num_threads()))
    tokens_per_step = args.batch * args.seq_len * args.accum
    losses, step_times, comm = [], [], None
    for step in range(args.steps):
        measure = step == args.steps - 1  # communication of one whole step: the last
        if measure:
            engine.reset_comm_stats()
        t0 = time.perf_counter()
        loss_sum = 0.0
        for micro in range(args.accum):
            x, y = data.batch(step * args.accum + micro, dp_rank, dp_world)
            out = engine(x, y)
            loss = out["loss"] / args.accum
            engine.backward(loss)
            loss_sum += float(loss.detach())
        applied = engine.step()
        engine.zero_grad()
        dt = time.perf_counter() - t0
        if measure:
            comm = {k: int(v) for k, v in engine.comm_stats().items() if k != "offload"}
        # The logged loss is averaged over ranks: a plain all-reduce outside the engine's counters.
        lt = torch.tensor([loss_sum], dtype=torch.float64)
        dist.all_reduce(lt)
        mean_loss = lt.item() / world
        if not math.isfinite(mean_loss) and applied:  # an fp16 skip may come with an inf loss
            raise JobError(f"loss is {mean_loss} at step {step + 1}")
        losses.append(mean_loss)
        step_times.append(dt)
        say(f"step {step + 1:4d}/{args.steps}  loss {mean_loss:.4f}  "
            f"{tokens_per_step / dt:9,.0f} tok/s  {dt * 1e3:7.1f} ms"
            + ("" if applied else "  (step skipped: fp16 overflow)"))

    report = engine.memory_report()
    mem = {k: int(v) for k, v in report.items() if k != "by_device"}
    k_bytes = accounting.optimizer_state_bytes("adamw", args.dtype, offload=args.offload_optimizer)
    placement = dict(reduce_dtype=args.reduce_dtype, offload_optimizer=args.offload_optimizer,
                     offload_params=args.offload_params, delayed_update=args.delayed_update is not None)
    return {
        "rank": rank,
        "numel": numel,
        "k_bytes": k_bytes,
        "memory": mem,
        "memory_by_device": {at: sum(v for k, v in c.items() if k in ("param", "grad", "optim"))
                             for at, c in report["by_device"].items()},
        "offload": engine.comm_stats().get("offload"),
        "memory_pred": accounting.predicted_memory(args.stage, numel, dp_world, args.dtype, k_bytes, **placement),
        "dp_world": dp_world,
        "activations": zerocore.activation_memory() if args.checkpoint == "zerocore" else None,
        "comm": comm,
        "comm_pred": accounting.predicted_comm(args.stage, numel, args.accum, engine.root_numel),
        "memory_dp": accounting.predicted_memory(0, numel, dp_world, args.dtype,
                                                 accounting.optimizer_state_bytes("adamw", args.dtype)),
        "uniform_loss": math.log(tok.vocab_size),
        "losses": losses,
        "step_times": step_times,
        "tokens_per_step": tokens_per_step,
        "engine_config": engine_cfg,
    }


def banner(args, world, corpus_name, corpus_tokens, vocab, numel, engine_cfg, threads) -> str:
    """What the job is about to do, printed by rank 0 before the first step."""
    precision = "fp32" if args.dtype == "fp32" else f"{args.dtype} compute with fp32 master weights"
    model = "GPT" if args.model == "gpt" else f"MoE GPT ({args.experts} experts, top-{args.top_k})"
    if args.tp > 1:
        model = f"tensor-parallel GPT (TP={args.tp} x DP={world // args.tp})"
    if args.checkpoint != "none":
        model += f", blocks checkpointed with {args.checkpoint}" + (" (offload to the host)" if args.offload else "")
    return "\n".join([
        f"zerocore: ZeRO stage {args.stage} on {world} CPU rank(s) (gloo), {precision}, "
        f"{threads} thread(s) per rank",
        f"model:  {model}, {args.layers} blocks x width {args.d_model} ({args.heads} heads), "
        f"{numel:,} trainable params",
        f"data:   the corpus bundled with the package ({corpus_name}, {corpus_tokens:,} characters), one token "
        f"per character, vocabulary {vocab}; each step {args.batch} sequences x {args.seq_len} tokens "
        f"x {args.accum} micro-batch(es), split over the ranks",
        f"loss:   cross-entropy in nats; guessing uniformly over the {vocab} characters scores "
        f"ln({vocab}) = {math.log(vocab):.3f}",
        f"engine: zerocore.Config({', '.join(f'{k}={v!r}' for k, v in engine_cfg.items())})",
        "",
    ])


MEMORY_LEGEND = """\
  Ψ = trainable params, N = data-parallel ranks, K = bytes of optimizer state per param
  (AdamW: m and v in fp32, plus an fp32 master copy of each param when training in 16 bits).
  param         training-dtype params this rank holds (stage 3: its 1/N shard between steps)
  grad          gradient buffers this rank holds (stages 2-3: its 1/N partition)
  optim         optimizer states of this rank's partition (K bytes a param)
  total         param + grad + optim: the model states the ZeRO paper counts
  buffers       the module's buffers (not model states; in no formula)
  comm_buffers  buffers collectives work in, allocated at wrap: the gradient reduction's staging
                buckets and, in stage 3, the pool units are gathered into (not model states; with
                experts, the pool grows once to the units the ranks need at the same time)
  formula       the ZeRO formula for this stage (docs/formulas.md, zerocore.sizing.accounting; offloaded, with
                the host's buffers too, docs/offload.md)
  plain DP      what plain data parallelism (stage 0, as DDP) would hold on every rank
  measured may exceed the formula by alignment padding; stage-3 params under --persist-threshold
  stay whole on every rank."""

COMM_LEGEND = """\
  Elements (not bytes) moved by each kind of collective in the last step, each collective counted at
  its full, unpartitioned size, as docs/formulas.md does: stages 1-2 reduce-scatter and all-gather Ψ
  (the volume of plain data parallelism's all-reduce), stage 3 all-gathers params twice (forward and
  backward), 1.5x, less the root's params (embeddings, head), which stay gathered from the root's
  forward through its backward, as in FSDP2. Stage 3 moves only the units some rank ran: with --model moe, experts that no
  rank's tokens were routed to are neither gathered nor reduced, so it may stay under the formula."""


def throughput_line(step_times: list, tokens_per_step: int, ranks: int) -> str:
    """The run's throughput in one line: tokens over seconds of every step
    but the first (its warm-up: first-touch of the buffers, torch's lazy
    initialisation), all ranks together and per rank."""
    timed = step_times[1:] or step_times
    first = len(step_times) - len(timed) + 1
    tokens, seconds = tokens_per_step * len(timed), sum(timed)
    steps = f"step {first}" if len(timed) == 1 else f"steps {first}-{len(step_times)}"
    return (f"throughput: {tokens / seconds:,.0f} tok/s over {steps} ({tokens:,} tokens in {seconds:.3f} s"
            + ("" if first == 1 else ", step 1 left out as warm-up")
            + f"), {tokens / seconds / ranks:,.0f} tok/s per rank")


def report(args, results: list) -> str:
    """The end-of-run summary (rank 0 prints it, for all ranks)."""
    r0 = results[0]
    world = r0["dp_world"]
    times = r0["step_times"][1:] or r0["step_times"]  # leave out the warm-up step
    med = sorted(times)[len(times) // 2]
    lines = [
        f"\nloss {r0['losses'][0]:.4f} -> {r0['losses'][-1]:.4f} over {len(r0['losses'])} steps "
        f"(uniform guess: {r0['uniform_loss']:.4f}); median step {med * 1e3:.1f} ms, "
        f"{r0['tokens_per_step'] / med:,.0f} tok/s (all ranks)",
        throughput_line(r0["step_times"], r0["tokens_per_step"], len(results)),
        f"\nmodel-state memory per rank, bytes: stage {args.stage}, Ψ = {r0['numel']:,}, N = {world}, "
        f"dtype {args.dtype}, K = {r0['k_bytes']}",
        f"  {'rank':>4}  {'category':<12} {'measured':>14} {'formula':>14} {'meas/form':>10} {'plain DP':>14}",
    ]
    for r in results:
        measured = dict(r["memory"])
        measured["total"] = sum(measured[k] for k in r["memory_pred"])
        formula = dict(r["memory_pred"], total=sum(r["memory_pred"].values()))
        plain_dp = dict(r["memory_dp"], total=sum(r["memory_dp"].values()))
        for k in list(formula) + [k for k in measured if k not in formula]:
            m, p = measured.get(k), formula.get(k)
            lines.append(f"  {r['rank']:>4}  {k:<12} {_fmt(m):>14} {_fmt(p):>14} {_ratio(m, p):>10} "
                         f"{_fmt(plain_dp.get(k)):>14}")
    dp_total, zero_total = sum(r0["memory_dp"].values()), sum(r0["memory_pred"].values())
    lines.append(f"  saved by ZeRO: plain data parallelism holds {_fmt(dp_total)} bytes of model states per rank, "
                 f"stage {args.stage} {_fmt(zero_total)} ({dp_total / zero_total:.2f}x less, formula)")
    lines.append(MEMORY_LEGEND)
    if args.offload_optimizer:
        lines.append("\noffloaded (ZeRO-Offload): model-state bytes per rank by where they live, and the bytes "
                     "copied between device and host since the last comm_stats reset")
        for r in results:
            lines.append(f"  rank {r['rank']}: device {_fmt(r['memory_by_device']['device'])}, host "
                         f"{_fmt(r['memory_by_device']['host'])}; grads to host "
                         f"{_fmt(r['offload']['grad_bytes_to_host'])}, params to device "
                         f"{_fmt(r['offload']['param_bytes_to_device'])}")
    lines.append(f"\ncommunication in one optimizer step, elements per collective kind: stage {args.stage}, "
                 f"Ψ = {r0['numel']:,}, {args.accum} backward call(s)")
    lines.append(f"  {'rank':>4}  {'collective':<15} {'measured':>14} {'formula':>14} {'meas/form':>10}")
    for r in results:
        comm = r["comm"] or {}
        for k in list(r["comm_pred"]) + [k for k in comm if k not in r["comm_pred"]]:
            m, p = comm.get(k), r["comm_pred"].get(k)
            lines.append(f"  {r['rank']:>4}  {k:<15} {_fmt(m):>14} {_fmt(p):>14} {_ratio(m, p):>10}")
    lines.append(COMM_LEGEND)
    if r0["activations"] is not None:
        lines += _activation_report(args, results)
    return "\n".join(lines)


def _activation_report(args, results) -> list:
    """Per rank, the bytes zerocore.checkpoint kept beside the same checkpoints whole."""
    lines = [f"\nactivation checkpoints per rank, bytes: the most held at once in the last step, partitioned "
             f"over TP={args.tp} (zerocore.checkpoint{', offloaded to the host' if args.offload else ''})",
             f"  {'rank':>4}  {'kept':>12} {'unpartitioned':>14} {'kept/unpart':>12} {'buffer':>12}"]
    for r in results:
        a = r["activations"]
        lines.append(f"  {r['rank']:>4}  {_fmt(a['kept']):>12} {_fmt(a['unpartitioned']):>14} "
                     f"{_ratio(a['kept'], a['unpartitioned']):>12} {_fmt(a['buffers']):>12}")
    lines.append("  kept: this rank's slices of the blocks' inputs (1/TP of each, padded to split evenly); "
                 "unpartitioned: the same checkpoints whole, as torch.utils.checkpoint keeps them on every rank; "
                 "buffer: the contiguous buffer they live in, allocated once, and offloaded, the device buffers "
                 "they are packed in and copied back to (memory_report()['activations'])")
    return lines


# ------------------------------------------------------------------ process plumbing


def _init_threads(args, local_world: int) -> None:
    import torch

    n = args.threads or max(1, (os.cpu_count() or 1) // max(1, local_world))
    import zerocore

    torch.set_num_threads(n)
    zerocore.set_num_threads(n)


def _gather_summaries(summary: dict, world: int) -> list:
    """Every rank's summary, on every rank. Pickled into byte tensors by hand:
    torch's all_gather_object needs numpy on gloo, and nothing else here does."""
    import torch
    import torch.distributed as dist

    payload = torch.frombuffer(bytearray(pickle.dumps(summary)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([payload.numel()]))
    longest = max(int(n) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:payload.numel()] = payload
    received = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(received, padded)
    return [pickle.loads(bytes(buf[:int(n)].tolist())) for buf, n in zip(received, sizes)]


def _run_rank(args, rank: int, world: int, local_world: int, init_method: str) -> None:
    """Initialise the process group, train, gather summaries to rank 0 and print them."""
    import torch.distributed as dist

    _init_threads(args, local_world)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))
    try:
        results = _gather_summaries(train(args, rank, world), world)
        if rank == 0:
            print(report(args, results), flush=True)
            if args.losses_out:
                with open(args.losses_out, "w") as f:
                    json.dump(results[0]["losses"], f)
    finally:
        dist.destroy_process_group()


def _spawned(local_rank: int, args, world: int, init_method: str) -> None:
    """Entry point of a process started by --ranks."""
    try:
        _run_rank(args, local_rank, world, world, init_method)
    except JobError as e:
        print(f"error (rank {local_rank}): {e}", file=sys.stderr, flush=True)
        raise SystemExit(1)


def main(argv=None) -> int:
    args = parse_args(argv)
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun / another launcher
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        try:
            _run_rank(args, rank, world, local_world, "env://")
        except JobError as e:
            print(f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
            return 1
        return 0

    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # everything is local
    with _rendezvous() as init_method:
        return _run_local(args, init_method)


def _run_local(args, init_method: str) -> int:
    """Runs the job on --ranks processes of this machine (1: this one)."""
    if args.ranks == 1:
        try:
            _run_rank(args, 0, 1, 1, init_method)
        except JobError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 1
        return 0

    import torch.multiprocessing as mp

    method = args.start_method or ("fork" if sys.platform.startswith("linux") else "spawn")
    ctx = mp.start_processes(_spawned, args=(args, args.ranks, init_method), nprocs=args.ranks,
                             join=False, start_method=method)
    # The collectives time out after --timeout; this is a backstop for a rank stuck elsewhere.
    deadline = time.monotonic() + args.timeout + 30.0 * args.steps * args.accum + 60.0
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise JobError("the job ran past its deadline; ranks terminated")
    except mp.ProcessExitedException as e:
        print(f"error: rank {e.error_index} exited with code {e.exit_code}"
              + ("" if e.exit_code == 1 else " (killed or crashed)"), file=sys.stderr, flush=True)
        return 1
    except mp.ProcessRaisedException as e:
        print(f"error: rank {e.error_index} failed:\n{e}", file=sys.stderr, flush=True)
        return 1
    except (JobError, KeyboardInterrupt) as e:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(5)
            if p.is_alive():
                p.kill()
        print(f"error: {e or 'interrupted'}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except JobError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
