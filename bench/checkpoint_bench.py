"""Checkpoint benchmark: engine.save and engine.load against a plain copy of the same bytes.

    python bench/checkpoint_bench.py                      # 2 ranks, stage 3, GPT 8 x 1024
    python bench/checkpoint_bench.py --world 4 --stage 1 --layers 4

A GPT-style model (zerocore.examples.gpt) is wrapped with AdamW on CPU
ranks (gloo) and trained one step, so every optimizer state is real. Then,
--repeats times, from a barrier: engine.save into a fresh folder (every rank
writes its own file, flushed to disk with fsync, then rank 0 commits), and
engine.load of it (every rank maps the files, checksums what it reads,
then copies it into its buffers). The time of each is the slowest rank's.
The peer: the same rank files copied with shutil.copyfile, one process per
rank at the same time, flushed with fsync too, so the same bytes go the
same way. Rates are the checkpoint's bytes over the time; the ratios are
zerocore's rate over the copy's. The best of --repeats runs is reported
(the page cache is warm after the first).
"""
from __future__ import annotations

import datetime
import os
import platform
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import _harness as harness
import zerocore
from zerocore.examples.gpt import GPT, GPTConfig


def _copy(src_files, dst_dir):
    for f in src_files:
        out = os.path.join(dst_dir, os.path.basename(f))
        shutil.copyfile(f, out)
        with open(out, "rb+") as fh:
            os.fsync(fh.fileno())


def _timed(fn):
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _measure(rank, port, args, root):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world,
                            timeout=datetime.timedelta(minutes=10))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=args.vocab, n_layer=args.layers, n_head=8, d_model=args.dim, seq_len=64))
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), {"stage": args.stage})
    idx = torch.randint(0, args.vocab, (2, 65))
    engine.backward(engine(idx[:, :-1], idx[:, 1:])["loss"])
    engine.step()
    rows = []
    for repeat in range(args.repeats):
        path = os.path.join(root, f"ckpt{repeat}")
        save = _timed(lambda: engine.save(path))
        load = _timed(lambda: engine.load(path))
        folder = next(e for e in os.listdir(path) if e != "zerocore.json")
        mine = [os.path.join(path, folder, f) for f in sorted(os.listdir(os.path.join(path, folder)))][rank::args.world]
        copy_dir = os.path.join(root, f"copy{repeat}")
        os.makedirs(copy_dir, exist_ok=True)
        copy = _timed(lambda: _copy(mine, copy_dir))
        nbytes = sum(os.path.getsize(os.path.join(path, folder, f)) for f in os.listdir(os.path.join(path, folder)))
        rows.append((save, load, copy, nbytes))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)
            shutil.rmtree(copy_dir)
    dist.destroy_process_group()
    return engine.num_trainable_params, rows


def main():
    parser = harness.parser(__doc__, worker=False)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(dir=args.dir, prefix="zerocore-ckpt-bench-")
    try:
        numel, rows = harness.fork_ranks(_measure, args.world, args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = rows[0][3] / 1e9
    save, load, copy = (min(r[i] for r in rows) for i in range(3))
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{datetime.date.today()}")
    print(f"# GPT {args.layers} x {args.dim}, {numel / 1e6:.1f}M params, stage {args.stage}, {args.world} ranks, "
          f"checkpoint {gb:.2f} GB, best of {args.repeats}")
    print(f"{'':>6} {'seconds':>8} {'GB/s':>6} {'vs copy':>8}")
    for name, t in (("copy", copy), ("save", save), ("load", load)):
        print(f"{name:>6} {t:8.3f} {gb / t:6.2f} {copy / t:8.2f}")


if __name__ == "__main__":
    sys.exit(main())
