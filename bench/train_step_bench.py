"""Training-step benchmark: zerocore stages 0-3 vs DDP vs FSDP2 on CPU ranks (gloo).

    python bench/train_step_bench.py                       # 2 ranks, fp32, all configs
    python bench/train_step_bench.py --dtype bf16 --steps 6
    python bench/train_step_bench.py --configs zero3,fsdp2 --repeats 3
    python bench/train_step_bench.py --model moe --experts 8  # mixture of experts
    python bench/train_step_bench.py --configs zero3,ddp --breakdown  # where the step's time goes

The same GPT-style model (zerocore.examples.gpt, or with --model moe its
mixture-of-experts variant, zerocore.examples.moe: each expert its own
stage-3 unit, so ranks run different units), the same data and the same
world size are trained a few steps under each configuration:

    zero0..zero3  zerocore.wrap(model, AdamW, Config(stage=s, dtype=...))
    ddp           torch DistributedDataParallel + torch.optim.AdamW
                  (16-bit: torch.autocast over fp32 params, as DDP users do;
                  MoE: find_unused_parameters, which experts need)
    fsdp2         torch.distributed.fsdp.fully_shard per block and on the root
                  + torch.optim.AdamW (16-bit: MixedPrecisionPolicy with
                  param_dtype = reduce_dtype = the dtype, like zerocore's
                  default reduce_dtype; MoE: a block's experts inside its
                  unit, as FSDP needs: per-expert units would hang)

Every configuration runs in fresh processes (one per rank), so the peak
resident set size (getrusage ru_maxrss) is that configuration's own. Step
time is the median over the steps after --warmup, each measured from a
barrier, and with --repeats R the lowest of the R medians (configurations
interleave, so a noisy neighbour hits them alike). Peak memory is the
largest peak RSS over ranks (median over repeats); "train" memory is the
peak minus the RSS right after start-up (imports and process group), i.e.
what the model, optimizer and training added. The default model (8 x 512,
25.3M params) makes model states, not activations, the bulk of "train".
16-bit runs are slow on CPUs without native bf16 (AVX2 only: ~7x fp32),
hence fp32 by default; --dtype bf16 compares like for like in bf16.

Targets (the runtime issue; run once with default glibc settings and once
with MALLOC_MMAP_THRESHOLD_=1048576): zero3 step time <= 0.85x FSDP2's, zero3
"train" memory (peak RSS growth) <= 0.8x FSDP2's, zero3 peak RSS below DDP's,
zero1 and zero2 step time within 5% of DDP's. Each prints PASS or MISS.

Stage 3's ranks agree on every gather in rounds (docs/runtime.md);
zero3 also reports the rounds per step and the time spent in their
all-reduces as a share of the step (information: it includes waiting for
the slower rank, which without rounds is spent waiting elsewhere). To
measure what a change to the engine costs, --baseline-python names the
interpreter of another build (a venv with an earlier commit installed):
each zerocore config then also runs there as "<config>@base", interleaved,
and the ratio is printed. Target (the divergent-routing issue, its rounds
against the commit before them): zero3 within 3% of zero3@base on the
dense model.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import sys
import time

import _harness as harness
from _memory import mark_phase, print_phases, rss_kb
from step_breakdown import StepBreakdown, collectives_alone, print_breakdown, stage3_schedule

CONFIGS = ("zero0", "zero1", "zero2", "zero3", "ddp", "fsdp2")


def parse_args(argv=None):
    p = harness.parser(__doc__, CONFIGS)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=1, help="runs of each config (lowest median step time, median memory); configs interleave")
    p.add_argument("--model", default="gpt", choices=("gpt", "moe"))
    p.add_argument("--experts", type=int, default=8, help="--model moe: experts per block")
    p.add_argument("--top-k", type=int, default=2, choices=(1, 2), help="--model moe: experts per token")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    p.add_argument("--bucket-bytes", type=int, default=None, help="zerocore bucket_bytes (engine default if unset)")
    p.add_argument("--torch-optim", default="fused", choices=("fused", "foreach", "forloop"),
                   help="implementation of torch.optim.AdamW for DDP and FSDP2")
    p.add_argument("--threads", type=int, default=None, help="threads per rank (default cores / ranks)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration before it is killed")
    p.add_argument("--json", default=None, help="also write all results to this file")
    p.add_argument("--baseline-python", default=None,
                   help="another build's interpreter: zerocore configs also run with it, as <config>@base")
    p.add_argument("--breakdown", action="store_true",
                   help="time each step's phases and, at stage 3, its hooks, rounds and native calls, and the "
                        "step's collectives alone against DDP's (step_breakdown.py)")
    p.add_argument("--phases", action="store_true",
                   help="print rank 0's RSS, peak RSS and glibc heap after each phase (and within the first 3 steps)")
    return p.parse_args(argv)


# ------------------------------------------------------------------ one rank


def worker(args) -> None:
    import resource
    from datetime import timedelta

    import torch

    from zerocore.examples.gpt import GPT, GPTConfig, TextData

    name, rank, world = args.worker, args.rank, args.ranks
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    dist = harness.init_group(args, world, timeout=timedelta(seconds=args.timeout))
    dist.barrier()
    base_kb = rss_kb()
    # RSS, peak so far and glibc heap (in use, free but kept) after each
    # phase, MB: where the memory goes. Within the first steps, after each of
    # forward, backward and optimizer step too.
    phases = {}
    mark = functools.partial(mark_phase, phases)
    probe_step = [None]  # the step being probed, or None

    breakdown = StepBreakdown() if args.breakdown else None
    trace = []  # zerocore: the data-plane collectives of the last step

    def probe(phase):
        if probe_step[0] is not None and phase != "zero_grad":
            mark(f"s{probe_step[0] + 1}.{phase}")
        if breakdown:
            breakdown.phase(phase)

    data, tok = TextData.from_corpus(args.seq_len, args.batch, seed=0)
    shape = dict(vocab=tok.vocab_size, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                 seq_len=args.seq_len)
    if args.model == "moe":
        from zerocore.examples.moe import MoEConfig, MoEGPT

        model = MoEGPT(MoEConfig(**shape, n_experts=args.experts, top_k=args.top_k), seed=0)
    else:
        model = GPT(GPTConfig(**shape), seed=0)
    lowp = {"fp32": None, "bf16": torch.bfloat16}[args.dtype]
    mark("model")

    def torch_opt(params):
        kw = {"fused": args.torch_optim == "fused", "foreach": args.torch_optim == "foreach"}
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **kw)

    if name.startswith("zero"):
        import zerocore  # the baseline build's, under --baseline-python

        zerocore.set_num_threads(threads)
        cfg_kw = {"stage": int(name[4:]), "dtype": args.dtype}
        if args.bucket_bytes:
            cfg_kw["bucket_bytes"] = args.bucket_bytes
        engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1),
                               zerocore.Config(**cfg_kw))
        schedule = stage3_schedule(engine)  # None at stages 0-2, or on a baseline build from before rounds

        if breakdown and schedule:
            breakdown.instrument(engine)

        def step(x, y):
            if schedule:
                rounds, round_s = schedule.rounds, schedule.round_seconds
            loss = engine(x, y)["loss"]
            probe("fwd")
            engine.backward(loss)
            probe("bwd")
            trace[:] = engine.parts.comm.trace  # the step's data-plane collectives (the step's check restarts it)
            engine.step()
            probe("opt")
            engine.zero_grad()
            probe("zero_grad")
            if schedule:
                negotiation.append((schedule.rounds - rounds, schedule.round_seconds - round_s))
            return loss
    elif name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, find_unused_parameters=args.model == "moe")
        step = harness.torch_step(ddp, torch_opt(model.parameters()), probe, dtype=lowp)
    elif name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        kw = {"mesh": mesh}
        if lowp is not None:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=lowp, reduce_dtype=lowp)
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        step = harness.torch_step(model, torch_opt(model.parameters()), probe)  # its policy casts
    else:
        raise SystemExit(f"unknown config {name!r}; use one of {', '.join(CONFIGS)}")

    mark("wrapped")
    times, losses = [], []
    negotiation = []  # zero3: (rounds, seconds in them) per step
    for i in range(args.warmup + args.steps):
        x, y = data.batch(i, rank, world)
        dist.barrier()
        probe_step[0] = i if args.phases and i < 3 else None
        if breakdown:
            breakdown.begin()
        t0 = time.perf_counter()
        loss = step(x, y)
        dt = time.perf_counter() - t0
        if breakdown:
            breakdown.end()
        losses.append(float(loss.detach()))
        if i >= args.warmup:
            times.append(dt)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = {"config": name, "rank": rank, "median_s": statistics.median(times), "times": times,
              "losses": losses, "base_kb": base_kb, "phases": phases, "peak_kb": peak_kb,
              "params": sum(p.numel() for p in model.parameters())}
    if breakdown:
        result["breakdown"] = breakdown.medians(args.warmup)
        if name == "zero3":
            result["alone"] = collectives_alone(engine, trace)
    if negotiation:
        timed = negotiation[args.warmup:]
        result["rounds_per_step"] = statistics.median(n for n, _ in timed)
        result["round_share"] = statistics.median(s / t for (_, s), t in zip(timed, times))
    dist.barrier()
    dist.destroy_process_group()
    harness.send_result(result)


# ------------------------------------------------------------------ driver


def run_config(args, label: str) -> dict:
    """Run one configuration in fresh processes; return the per-config summary or raise.
    "<config>@base" runs <config> under --baseline-python."""
    name, _, at = label.partition("@")
    python = args.baseline_python if at else sys.executable
    base = harness.worker_command(__file__, name, python)
    passthrough = ["--ranks", str(args.ranks), "--dtype", args.dtype, "--steps", str(args.steps),
                   "--model", args.model, "--experts", str(args.experts), "--top-k", str(args.top_k),
                   "--warmup", str(args.warmup), "--layers", str(args.layers), "--d-model", str(args.d_model),
                   "--heads", str(args.heads), "--seq-len", str(args.seq_len), "--batch", str(args.batch),
                   "--torch-optim", args.torch_optim, "--timeout", str(args.timeout)]
    if args.bucket_bytes:
        passthrough += ["--bucket-bytes", str(args.bucket_bytes)]
    if args.threads:
        passthrough += ["--threads", str(args.threads)]
    if args.phases:  # probing within steps costs time: only when asked
        passthrough += ["--phases"]
    if args.breakdown:
        passthrough += ["--breakdown"]
    ranks = harness.run_ranks(label, base + passthrough, args.ranks, args.timeout)
    return {
        "config": label,
        "median_s": max(r["median_s"] for r in ranks),
        "peak_mb": max(r["peak_kb"] for r in ranks) / 1024,
        "train_mb": max(r["peak_kb"] - r["base_kb"] for r in ranks) / 1024,
        "final_loss": ranks[0]["losses"][-1],
        "params": ranks[0]["params"],
        "ranks": ranks,
        "round_share": max(r.get("round_share", 0.0) for r in ranks),
        "rounds_per_step": ranks[0].get("rounds_per_step"),
    }


def drive(args) -> int:
    names = harness.config_names(args.configs, CONFIGS)
    if args.baseline_python:
        names += [f"{n}@base" for n in names if n.startswith("zero")]

    import torch

    model = "GPT" if args.model == "gpt" else f"MoE GPT ({args.experts} experts, top-{args.top_k})"
    print(f"train_step_bench: {args.ranks} CPU ranks (gloo), {args.dtype}, {model} {args.layers}x{args.d_model} "
          f"heads {args.heads} seq {args.seq_len} global batch {args.batch}, {args.steps} timed steps "
          f"after {args.warmup} warm-up, torch {torch.__version__} AdamW {args.torch_optim}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", flush=True)
    def show(rep, name, res):
        print(f"  [{rep + 1}/{args.repeats}] {name:<10} median step {res['median_s'] * 1e3:8.1f} ms   "
              f"peak RSS {res['peak_mb']:7.1f} MB   train {res['train_mb']:6.1f} MB   "
              f"loss {res['final_loss']:.4f}" + (f"   rounds {res['rounds_per_step']:.0f}/step, "
              f"{100 * res['round_share']:.2f}% of it" if res["rounds_per_step"] else ""), flush=True)
        if args.phases:
            print_phases(res["ranks"][0]["phases"])
        if args.breakdown:
            print_breakdown(res["ranks"])

    runs, failed = harness.run_interleaved(names, args.repeats, lambda name: run_config(args, name), show)
    # Time: the best (lowest) median over repeats, since interference only adds.
    # Memory: the median over repeats (allocator noise goes both ways).
    best = {}
    for name, rs in runs.items():
        best[name] = dict(min(rs, key=lambda r: r["median_s"]),
                          peak_mb=statistics.median(r["peak_mb"] for r in rs),
                          train_mb=statistics.median(r["train_mb"] for r in rs))

    if best:
        params = next(iter(best.values()))["params"]
        print(f"\nresults ({params:,} params; step: best median of {args.repeats} run(s); memory: max over ranks, "
              f"median over runs)")
        print(f"  {'config':<10} {'step ms':>9} {'peak RSS MB':>12} {'train MB':>9}")
        for name in names:
            if name in best:
                r = best[name]
                print(f"  {name:<10} {r['median_s'] * 1e3:9.1f} {r['peak_mb']:12.1f} {r['train_mb']:9.1f}")

    if best.get("zero3", {}).get("rounds_per_step"):
        print(f"\nzero3 rounds: {best['zero3']['rounds_per_step']:.0f} a step, their all-reduces "
              f"{100 * best['zero3']['round_share']:.2f}% of the step, waiting for the slower rank included (info)")
    print("\nratios")
    ratios = harness.Ratios(best, width=44)
    if args.baseline_python:
        if args.model == "gpt":
            ratios.target("zero3 / zero3@base step time (rounds' cost)", "zero3", "zero3@base", 1.03, "median_s")
        for n in names:
            if n.endswith("@base") and (n[:-5] != "zero3" or args.model != "gpt"):
                ratios.info(f"{n[:-5]} / {n} step time", n[:-5], n, "median_s")
    ratios.target("zero3 / fsdp2 step time", "zero3", "fsdp2", 0.85, "median_s")
    ratios.target("zero3 / fsdp2 train memory (peak RSS growth)", "zero3", "fsdp2", 0.8, "train_mb")
    ratios.target("zero3 / ddp peak RSS", "zero3", "ddp", 1.0, "peak_mb")
    ratios.target("zero1 / ddp step time", "zero1", "ddp", 1.05, "median_s")
    ratios.target("zero2 / ddp step time", "zero2", "ddp", 1.05, "median_s")
    ratios.info("zero3 / fsdp2 peak RSS", "zero3", "fsdp2", "peak_mb")
    ratios.info("zero0 / ddp step time", "zero0", "ddp", "median_s")
    return harness.finish(args, failed, {"results": best, "runs": runs})


def main(argv=None) -> int:
    args = parse_args(argv)
    return harness.dispatch(args, worker, drive)


if __name__ == "__main__":
    sys.exit(main())
