"""In-memory snapshots' cost: the step with Config(snapshot="memory") at one
snapshot a step, against the same step without.

    python bench/snapshot_bench.py                        # 2 ranks, stage 3, GPT 4 x 512, batch 8 x 64
    python bench/snapshot_bench.py --stage 1 --every 4

Each rank wraps two copies of one GPT-style model (zerocore.examples.gpt)
with AdamW, one with snapshots (into a fresh folder under /dev/shm, one
per rank, as on a node of its own, so that each rank's snapshot is
mirrored on the other: snapshot_copies=1) and one without, and trains
them in turns, --steps steps each per round, for --rounds rounds, so both
see the same machine. A step is forward, backward, step and zero_grad, timed from a
barrier to the slowest rank; the snapshot's own work (its copy at the
step, checksummed in the same pass where it is in host memory, then at
the next forward its header and mirror, on the snapshots' thread behind
that forward and backward, waited for at the next snapshot) all falls
inside the steps timed. Reported: the median
step of each and their ratio (the target: at most 1.1); per rank the CPU
time of a step, every thread's (the block's last snapshot waited for), which
other jobs on a shared machine disturb less than wall time; and per rank
the bytes the snapshots hold (Snapshots.bytes_held: the files of its
folder, two steps of its own and of its mirror's) against the partition
they copy, and the process's peak resident memory. Last, the snapshot
alone, repeated with no step between (--alone times): the CPU time of
each piece, the copy with its checksums (take), the seal (the
manifest, the thread started) and the wait (the snapshots' thread: the
header, the rename, the mirrors sent and received), which a loaded
machine moves far less than a whole step.
"""
from __future__ import annotations

import datetime
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import _harness as harness
import zerocore
from zerocore.examples.gpt import GPT, GPTConfig
from zerocore.io.save_load import rank_tensors


def _engine(args, **snapshots):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=args.vocab, n_layer=args.layers, n_head=8, d_model=args.dim, seq_len=args.seq))
    return zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), {"stage": args.stage, **snapshots})


def _step(engine, idx):
    engine.backward(engine(idx[:, :-1], idx[:, 1:])["loss"])
    engine.optimizer.step()
    engine.optimizer.zero_grad()


def _timed_steps(engine, args, times, cpu):
    """args.steps steps: each one's wall time (the slowest rank's) into
    `times`; the CPU time this process spent on the whole block, its
    snapshots' thread included (waited for at the end), per step, into `cpu`."""
    cpu_start = time.process_time()
    for _ in range(args.steps):
        idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
        dist.barrier()
        start = time.perf_counter()
        _step(engine, idx)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    if engine.snapshots:
        engine.snapshots.wait()
    cpu.append((time.process_time() - cpu_start) / args.steps)


def _snapshot_alone(snapshots, repeats) -> tuple:
    """The median CPU time (all threads) of take, seal and wait, each
    snapshot a step of its own with no training between."""
    pieces = ([], [], [])
    for _ in range(repeats):
        snapshots.steps_done += 1  # as a step would
        dist.barrier()
        for spent, piece in zip(pieces, (snapshots.take, snapshots.seal, snapshots.wait)):
            start = time.process_time()
            piece()
            spent.append(time.process_time() - start)
    return tuple(statistics.median(p) for p in pieces)


def _measure(rank, port, args, root):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world,
                            timeout=datetime.timedelta(minutes=10))
    torch.set_num_threads(1)
    plain = _engine(args)
    snapshotting = _engine(args, snapshot="memory", snapshot_every=args.every,
                           snapshot_dir=os.path.join(root, f"node-{rank}"), snapshot_run_id="bench")
    times, cpu = {"plain": [], "snapshot": []}, {"plain": [], "snapshot": []}
    for engine in (plain, snapshotting):  # warm-up: the first steps allocate
        _step(engine, torch.randint(0, args.vocab, (args.batch, args.seq + 1)))
    for _ in range(args.rounds):
        _timed_steps(plain, args, times["plain"], cpu["plain"])
        _timed_steps(snapshotting, args, times["snapshot"], cpu["snapshot"])
    snapshots = snapshotting.snapshots
    snapshots.wait()
    alone = _snapshot_alone(snapshots, args.alone)
    owned = sum(t.numel() * t.element_size() for t in rank_tensors(snapshotting.parts).values())
    row = (owned, snapshots.bytes_held, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           statistics.median(cpu["plain"]), statistics.median(cpu["snapshot"]), alone)
    rows = [None] * args.world
    dist.all_gather_object(rows, row)
    dist.destroy_process_group()
    return plain.num_trainable_params, times, rows


def main():
    parser = harness.parser(__doc__, worker=False)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--every", type=int, default=1, help="Config.snapshot_every")
    parser.add_argument("--steps", type=int, default=5, help="steps of each engine per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dir", default="/dev/shm", help="where the snapshot folder goes")
    parser.add_argument("--alone", type=int, default=8, help="snapshots alone, timed by piece")
    args = parser.parse_args()
    root = tempfile.mkdtemp(dir=args.dir, prefix="zerocore-snapshot-bench-")
    try:
        numel, times, rows = harness.fork_ranks(_measure, args.world, args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    plain, snap = statistics.median(times["plain"]), statistics.median(times["snapshot"])
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{datetime.date.today()}")
    print(f"# GPT {args.layers} x {args.dim}, {numel / 1e6:.1f}M params, stage {args.stage}, {args.world} ranks, "
          f"batch {args.batch} x {args.seq} per rank, a snapshot every {args.every} step(s), one mirror; "
          f"median of {len(times['plain'])} steps each")
    print(f"step without snapshots {plain * 1e3:8.1f} ms")
    print(f"step with snapshots    {snap * 1e3:8.1f} ms   ratio {snap / plain:.3f} (target <= 1.1)")
    for r, (owned, held, rss, cpu_plain, cpu_snap, _) in enumerate(rows):
        print(f"rank {r}: CPU per step {cpu_plain * 1e3:.1f} ms without, {cpu_snap * 1e3:.1f} ms with snapshots "
              f"(all threads): ratio {cpu_snap / cpu_plain:.3f}")
    for r, (owned, held, rss, *_) in enumerate(rows):
        print(f"rank {r}: partition copied {owned / 2**20:.1f} MiB; snapshots hold {held / 2**20:.1f} MiB "
              f"({held / owned:.2f}x: two steps of its own file and of its mirror's); "
              f"peak RSS {rss / 2**20:.0f} MiB (both engines)")
    for r, (*_, (take, seal, wait)) in enumerate(rows):
        print(f"rank {r}: a snapshot alone, CPU: copy and checksums {take * 1e3:.1f} ms, "
              f"seal {seal * 1e3:.1f} ms (the manifest), wait {wait * 1e3:.1f} ms (the thread: header, mirrors): "
              f"{(take + seal + wait) * 1e3:.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
