"""Config(deterministic=True) against the default: step time, model-state
memory and the bytes each collective moves, on the CPU GPT bench's model
(zerocore.examples.gpt, 8 x 512 by default) at stages 0-3 on CPU ranks
(gloo), with gradient accumulation.

    python bench/deterministic_bench.py                   # 2 ranks, stages 0-3, fp32
    python bench/deterministic_bench.py --ranks 3 --micro-batches 6

Each (stage, mode) trains in fresh processes, one per rank, with
--threads torch threads each (the contract fixes them); the step time is
the median over the timed steps, each from a barrier, with --repeats R the
lowest of R medians (the modes interleave); beside it rank 0's CPU time a
step (its process's, every thread), the measure that holds on a machine
other jobs load. Memory is memory_report()'s
model states (params + grads + optimizer states; in deterministic mode the
exact sums count as grads: int40 in the grad partition at stages 2-3) and its comm buffers (stages 2-3: the staging,
int64 in deterministic mode). Bytes per collective: comm_stats()'s elements
times their size for the data plane (int64 for the grads' reductions in
deterministic mode), and deterministic mode's agreements (control plane),
per step on one rank.
Targets (the issue's, at stage 3): time <= 1.25x and memory <= 1.1x the
default's.
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

import _harness as harness
import zerocore
from zerocore.examples.gpt import GPT, GPTConfig

ELEMENT_BYTES = {"fp32": 4, "bf16": 2}


def _measure(rank, port, args, stage, deterministic):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks,
                            timeout=datetime.timedelta(seconds=300))
    model = GPT(GPTConfig(vocab=256, n_layer=args.layers, n_head=8, d_model=args.d_model, seq_len=args.seq_len))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = zerocore.wrap(model, opt, zerocore.Config(stage=stage, dtype=args.dtype, deterministic=deterministic))
    g = torch.Generator().manual_seed(rank)
    per_rank = args.micro_batches // args.ranks
    times, cpu = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            engine.reset_comm_stats()
            moved_before = engine.parts.exact.bytes_moved if engine.parts.exact else 0
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(per_rank):
            idx = torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=g)
            engine.backward(engine(idx[:, :-1], idx[:, 1:])["loss"])
        engine.step()
        engine.zero_grad()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    report = engine.memory_report()
    stats = engine.comm_stats()
    data = {k: v * ELEMENT_BYTES[args.dtype] / args.steps for k, v in stats.items()
            if isinstance(v, (int, float)) and k in ("all_reduce", "reduce_scatter", "all_gather")}
    if engine.parts.exact:  # the grads' reductions move int64: 8 bytes an element, not the dtype's
        for kind in ("all_reduce", "reduce_scatter"):
            if kind in data:
                data[kind] *= 8 / ELEMENT_BYTES[args.dtype]
        data["agreements (control all-gathers)"] = (engine.parts.exact.bytes_moved - moved_before) / args.steps
    engine.close()
    dist.destroy_process_group()
    return (statistics.median(times[args.warmup:]), report["param"] + report["grad"] + report["optim"],
            report["comm_buffers"], data, statistics.median(cpu[args.warmup:]))


def run(args, stage, deterministic):
    return harness.fork_ranks(_measure, args.ranks, args, stage, deterministic)


def main():
    p = harness.parser(__doc__, worker=False)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--dtype", default="fp32", choices=tuple(ELEMENT_BYTES))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--micro-batches", type=int, default=4, help="per step, over all ranks")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {args.ranks} "
          f"ranks x {args.threads} thread(s), GPT {args.layers} x {args.d_model}, {args.dtype}, "
          f"{args.micro_batches} micro-batches of {args.batch} x {args.seq_len} a step")
    for stage in map(int, args.stages.split(",")):
        best = {}
        for _ in range(args.repeats):
            for det in (False, True):
                best.setdefault(det, []).append(run(args, stage, det))
        (t0, m0, b0, d0, _), (t1, m1, b1, d1, _) = (min(best[det], key=lambda r: r[0]) for det in (False, True))
        c0, c1 = (min(r[4] for r in best[det]) for det in (False, True))
        print(f"stage {stage}: step {t0 * 1e3:.0f} ms -> {t1 * 1e3:.0f} ms deterministic ({t1 / t0:.2f}x, target "
              f"<= 1.25x: {'PASS' if t1 / t0 <= 1.25 else 'MISS'}); CPU a step, rank 0 {c0 * 1e3:.0f} -> "
              f"{c1 * 1e3:.0f} ms ({c1 / c0:.2f}x); model states {m0 / 2**20:.1f} -> "
              f"{m1 / 2**20:.1f} MiB ({m1 / m0:.2f}x, target <= 1.1x: {'PASS' if m1 / m0 <= 1.1 else 'MISS'}); "
              f"comm buffers {b0 / 2**20:.1f} -> {b1 / 2**20:.1f} MiB")
        for label, data in (("default", d0), ("deterministic", d1)):
            moved = ", ".join(f"{k} {v / 2**20:.1f} MiB" if v >= 2**16 else f"{k} {v:.0f} B"
                              for k, v in data.items() if v)
            print(f"  bytes per step, rank 0, {label}: {moved or 'none'}")


if __name__ == "__main__":
    main()
