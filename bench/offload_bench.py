"""ZeRO-Offload on the CPU: the host step's pipeline and the delayed
parameter update, against the same work done step by step.

    python bench/offload_bench.py
    python bench/offload_bench.py --layers 8 --d-model 768 --steps 8

One rank (a gloo group of one) trains a GPT (zerocore/examples/gpt.py) in
bf16 with AdamW, stage 2. The machine is split in two the way a GPU
machine is: torch's forward and backward run on one thread ("the
device"), zerocore's host optimizer on another ("the host": zerocore's
thread pool of --host-threads). Configurations, on the same batches:

    on device   no offload: the update where the params live
    serial      offload, step by step: grads down, the whole update, then
                the params up
    overlapped  offload as it ships: each bucket's params go up while the
                next bucket updates
    delayed     overlapped plus delayed_update (after 1 warm-up step): the
                update of step t runs while step t+1 computes

A step's time is split into its forward/backward ("compute") and its
engine.step() ("step"), medians over the timed steps, the lowest median of
--repeats interleaved runs. Printed as ratios: the overlapped step phase to
the serial one (the copies hidden behind the update), and the share of the
overlapped step phase that the delayed update hides behind compute (1 -
delayed step phase / overlapped step phase).
"""
from __future__ import annotations

import os
import statistics
import time

import _harness as harness

CONFIGS = ("on device", "serial", "overlapped", "delayed")


def parse_args(argv=None):
    p = harness.parser(__doc__, worker=False)
    for flag, default in (("--layers", 6), ("--d-model", 512), ("--heads", 8), ("--seq-len", 64), ("--batch", 4)):
        p.add_argument(flag, type=int, default=default, help="the model's and batch's shape")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the delayed update starts after 1)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved runs of every configuration")
    p.add_argument("--host-threads", type=int, default=1, help="zerocore's threads (the host)")
    return p.parse_args(argv)


def _engine(args, config):
    import torch

    import zerocore
    from zerocore.examples.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab=256, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                          seq_len=args.seq_len))
    cfg = dict(stage=2, dtype="bf16", max_grad_norm=1.0)
    if config != "on device":
        cfg["offload_optimizer"] = "cpu"
    if config == "delayed":
        cfg.update(delayed_update=True, delayed_update_warmup=1)
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), zerocore.Config(**cfg))
    if config == "serial":
        engine.parts.update.serial = True
    return engine


def _phases(args, engine, batches):
    """Median seconds of forward+backward and of step() over the timed steps."""
    compute, step = [], []
    for i, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        engine.backward(engine(x, y)["loss"])
        t1 = time.perf_counter()
        engine.step()
        engine.zero_grad()
        t2 = time.perf_counter()
        if i >= args.warmup:
            compute.append(t1 - t0)
            step.append(t2 - t1)
    return statistics.median(compute), statistics.median(step)


def main(argv=None):
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    import zerocore

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{harness.free_port()}", rank=0, world_size=1)
    torch.set_num_threads(1)
    zerocore.set_num_threads(args.host_threads)
    g = torch.Generator().manual_seed(0)
    batches = [tuple(t.split(args.seq_len, dim=1))
               for t in [torch.randint(0, 256, (args.batch, 2 * args.seq_len), generator=g)
                         for _ in range(args.warmup + args.steps)]]
    runs = {c: [] for c in CONFIGS}
    numel = 0
    for _ in range(args.repeats):
        for config in CONFIGS:
            engine = _engine(args, config)
            numel = engine.num_trainable_params
            runs[config].append(_phases(args, engine, batches))
            del engine
    best = {c: min(r, key=sum) for c, r in runs.items()}
    lines = [f"GPT {args.layers} x {args.d_model} ({numel / 1e6:.1f}M params), seq {args.seq_len}, batch "
             f"{args.batch}, bf16, AdamW, stage 2, 1 rank; compute on 1 thread, host optimizer on "
             f"{args.host_threads}; {args.steps} timed steps after {args.warmup}, best of {args.repeats}; "
             f"{os.cpu_count()} CPUs",
             f"  {'config':<11} {'compute ms':>11} {'step ms':>9} {'total ms':>9} {'total / serial':>15}"]
    serial_total = sum(best["serial"])
    for config in CONFIGS:
        c, s = best[config]
        lines.append(f"  {config:<11} {c * 1e3:11.1f} {s * 1e3:9.1f} {(c + s) * 1e3:9.1f} "
                     f"{(c + s) / serial_total:15.3f}")
    overlap = best["overlapped"][1] / best["serial"][1]
    hidden = 1 - best["delayed"][1] / best["overlapped"][1]
    lines.append(f"  overlapped step / serial step: {overlap:.3f}; share of the overlapped step the delayed "
                 f"update hides behind compute: {hidden:.3f}")
    print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
