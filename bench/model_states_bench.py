"""Memory benchmark where model states dominate: peak RSS growth against the
formula's model states, zerocore stage 3 vs FSDP2, DDP and DeepSpeed ZeRO-3.

    python bench/model_states_bench.py                     # all configs, 2 ranks
    python bench/model_states_bench.py --configs zero3 --phases
    MALLOC_MMAP_THRESHOLD_=1048576 python bench/model_states_bench.py

The model: --layers blocks of Linear(--width, --width) + GELU (12 x 2048:
50.4M params), an MSE loss, --batch rows a rank, fp32, AdamW, torch threads
1. Each system builds it on its own large-model path:

    zero3      zerocore.init() (the meta device), zerocore.wrap(Config(stage=3)),
               which initialises each rank's shard (reset_parameters replayed)
    zero3-det  the same with Config(deterministic=True) (docs/deterministic.md):
               its growth over zero3's is issue 33's memory target, <= 1.1x
    fsdp2      the meta device, fully_shard per block and on the root,
               to_empty(device="cpu"), reset_parameters on each Linear,
               torch.optim.AdamW
    ddp        built on the CPU (DDP has no sharded path), DistributedDataParallel,
               torch.optim.AdamW
    deepspeed  built under deepspeed.zero.Init, ZeRO stage 3 with DeepSpeed's
               default buffer sizes, torch.optim.AdamW as the client optimizer
               (DS_ACCELERATOR=cpu, deepspeed.init_distributed(dist_backend="gloo"))

Every configuration runs in fresh processes, one per rank. A rank imports
its system and joins the process group, then takes its RSS as the baseline;
"growth" is its peak RSS (getrusage ru_maxrss) over that baseline, the
largest over ranks, and is printed as a multiple of the model states the
ZeRO formula gives a rank, 16 Psi / N bytes (fp32 params, grads and Adam's
two moments, all sharded: zerocore.sizing.accounting.predicted_memory). Target (the
runtime issue's): zero3 at most 1.15x. The step time printed beside it
(the median over the steps after the first, slowest rank) is information.
--phases prints rank 0's RSS, peak RSS and glibc heap after the model is
built, after wrap and after the forward, backward and optimizer step of
each step; zero3 also prints its memory_report().
"""
from __future__ import annotations

import functools
import importlib
import os
import sys
import time

import _harness as harness
from _memory import mark_phase, print_phases, rss_kb

CONFIGS = ("zero3", "zero3-det", "fsdp2", "ddp", "deepspeed")
TARGET = 1.15  # zero3's growth / 16 Psi / N
DETERMINISTIC_TARGET = 1.1  # zero3-det's growth / zero3's (issue 33)


def parse_args(argv=None):
    p = harness.parser(__doc__, CONFIGS)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="rows a rank")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1, help="runs of each config (median growth); configs interleave")
    p.add_argument("--bucket-bytes", type=int, default=None, help="zero3: Config.bucket_bytes (default: the engine's)")
    p.add_argument("--prefetch-bytes", type=int, default=None,
                   help="zero3: Config.prefetch_bytes (default: the engine's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration before it is killed")
    p.add_argument("--phases", action="store_true", help="print rank 0's memory after each phase")
    return p.parse_args(argv)


# ------------------------------------------------------------------ one rank


def build(args):
    """The model, on whatever device is current."""
    import torch.nn.functional as F
    from torch import nn

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(args.width, args.width), nn.GELU())
                                        for _ in range(args.layers))

        def forward(self, x, y):
            for block in self.blocks:
                x = block(x)
            return F.mse_loss(x, y)

    return Blocks()


def _adamw(params):
    import torch

    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)


def _zero3(args, mark, deterministic=False):
    import zerocore

    zerocore.set_num_threads(1)
    with zerocore.init():
        model = build(args)
    mark("model")
    cfg = {"stage": 3, "deterministic": deterministic}
    if args.bucket_bytes is not None:
        cfg["bucket_bytes"] = args.bucket_bytes
    if args.prefetch_bytes is not None:
        cfg["prefetch_bytes"] = args.prefetch_bytes
    engine = zerocore.wrap(model, _adamw(model.parameters()), zerocore.Config(**cfg))

    def update():
        engine.step()
        engine.zero_grad()

    return _step(engine, engine.backward, update), engine.memory_report, engine.close  # its threads end before the process groups go


def _fsdp2(args, mark):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = build(args)
    mark("model")
    mesh = init_device_mesh("cpu", (args.ranks,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.reset_parameters()
    return _torch_step(model, _adamw(model.parameters())), None, None


def _ddp(args, mark):
    from torch.nn.parallel import DistributedDataParallel

    model = build(args)
    mark("model")
    ddp = DistributedDataParallel(model)
    return _torch_step(ddp, _adamw(model.parameters())), None, None


def _torch_step(model, opt):
    def update():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _step(model, lambda loss: loss.backward(), update)


def _step(forward, backward, update):
    """A training step, step(x, y, probe), calling probe(phase) after each phase."""

    def step(x, y, probe):
        loss = forward(x, y)
        probe("fwd")
        backward(loss)
        probe("bwd")
        update()
        probe("opt")
        return loss

    return step


def _deepspeed(args, mark):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}}  # DeepSpeed's default buckets and prefetch
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build(args)
    mark("model")
    engine, *_ = deepspeed.initialize(model=model, optimizer=_adamw(model.parameters()), config=config)

    return _step(engine, engine.backward, engine.step), None, None


SYSTEMS = {"zero3": _zero3, "zero3-det": functools.partial(_zero3, deterministic=True), "fsdp2": _fsdp2, "ddp": _ddp, "deepspeed": _deepspeed}


# What each system imports before the baseline is taken.
IMPORTS = {"zero3": "zerocore", "zero3-det": "zerocore", "fsdp2": "torch.distributed.fsdp", "ddp": "torch.nn.parallel",
           "deepspeed": "deepspeed"}


def _join(args):
    """Imports the system and joins the process group (the baseline is taken after)."""
    import torch.distributed as dist

    system = importlib.import_module(IMPORTS[args.worker])
    if args.worker == "deepspeed":  # DS_ACCELERATOR=cpu, set by the driver
        # DeepSpeed reads the launcher's variables (without them it looks for MPI).
        os.environ.update(harness.launcher_env(args, args.ranks))
        system.init_distributed(dist_backend="gloo", verbose=False)
    else:
        harness.init_group(args, args.ranks)
    return dist


def worker(args) -> None:
    import resource
    import statistics

    import torch

    torch.set_num_threads(1)
    dist = _join(args)
    dist.barrier()
    base_kb = rss_kb()
    phases = {}
    mark = functools.partial(mark_phase, phases)
    torch.manual_seed(0)  # the same initial values on every rank
    step, memory_report, close = SYSTEMS[args.worker](args, mark)
    mark("wrapped")
    gen = torch.Generator().manual_seed(1 + args.rank)
    times = []
    for i in range(args.steps):
        x, y = (torch.randn(args.batch, args.width, generator=gen) for _ in range(2))

        def probe(phase, i=i):
            if args.phases:
                mark(f"s{i + 1}.{phase}")

        dist.barrier()
        t0 = time.perf_counter()
        loss = step(x, y, probe)
        times.append(time.perf_counter() - t0)
    result = {"config": args.worker, "rank": args.rank, "base_kb": base_kb,
              "peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "phases": phases,
              "loss": float(loss.detach()), "step_s": statistics.median(times[1:] or times),
              "memory_report": memory_report() if memory_report else None}
    dist.barrier()
    if close:
        close()
    dist.destroy_process_group()
    harness.send_result(result)


# ------------------------------------------------------------------ driver


def model_states_bytes(args) -> tuple:
    """(Psi, 16 Psi / N): the params and the bytes of model states a rank
    holds by the formula (fp32 params and grads, AdamW's two moments, all
    sharded: stage 3)."""
    from zerocore.sizing import accounting

    psi = args.layers * (args.width * args.width + args.width)
    states = accounting.predicted_memory(3, psi, args.ranks, "fp32", accounting.optimizer_state_bytes("adamw", "fp32"))
    return psi, sum(states.values())


def run_config(args, name) -> dict:
    command = harness.worker_command(__file__, name) + [
        "--ranks", str(args.ranks), "--layers", str(args.layers), "--width", str(args.width),
        "--batch", str(args.batch), "--steps", str(args.steps)]
    for flag, value in (("--bucket-bytes", args.bucket_bytes), ("--prefetch-bytes", args.prefetch_bytes)):
        if value is not None:
            command += [flag, str(value)]
    if args.phases:
        command.append("--phases")
    ranks = harness.run_ranks(name, command, args.ranks, args.timeout,
                              env={"DS_ACCELERATOR": "cpu"} if name == "deepspeed" else None)
    return {"growth": max(r["peak_kb"] - r["base_kb"] for r in ranks) * 1024, "ranks": ranks,
            "step_s": max(r["step_s"] for r in ranks)}


def drive(args) -> int:
    import statistics

    names = harness.config_names(args.configs, CONFIGS)
    psi, states = model_states_bytes(args)
    print(f"model_states_bench: {args.ranks} CPU ranks (gloo), 1 thread each, {args.layers} x Linear({args.width}, "
          f"{args.width}) + GELU = {psi:,} params, batch {args.batch} a rank, fp32 AdamW, {args.steps} steps; "
          f"16 Psi / N = {states / 2**20:.1f} MiB", flush=True)

    def show(rep, name, res):
        print(f"  [{rep + 1}/{args.repeats}] {name:<9} peak RSS growth {res['growth'] / 2**20:7.1f} MiB = "
              f"{res['growth'] / states:5.2f} x 16 Psi / N   (step {res['step_s'] * 1e3:.0f} ms, info)", flush=True)
        if args.phases:
            print_phases(res["ranks"][0]["phases"])
            report = res["ranks"][0]["memory_report"]
            if report:
                print("         rank 0 memory_report, MiB: " + ", ".join(
                    f"{k} {v / 2**20:.1f}" for k, v in report.items() if k != "by_device"), flush=True)

    runs, failed = harness.run_interleaved(names, args.repeats, lambda name: run_config(args, name), show)
    print("\nresults (peak RSS growth over the post-start-up baseline, max over ranks, median over runs)")
    for name in names:
        if name in runs:
            g = statistics.median(r["growth"] for r in runs[name])
            verdict = f"  (target <= {TARGET}: {'PASS' if g / states <= TARGET else 'MISS'})" if name == "zero3" else ""
            print(f"  {name:<9} {g / 2**20:8.1f} MiB  {g / states:5.2f} x 16 Psi / N{verdict}")
    if "zero3" in runs and "zero3-det" in runs:
        plain, det = (statistics.median(r["growth"] for r in runs[n]) for n in ("zero3", "zero3-det"))
        print(f"  zero3-det / zero3: {det / plain:.2f}x (target <= {DETERMINISTIC_TARGET}: "
              f"{'PASS' if det / plain <= DETERMINISTIC_TARGET else 'MISS'})")
    return harness.finish(args, failed, {"runs": runs})


def main(argv=None) -> int:
    return harness.dispatch(parse_args(argv), worker, drive)


if __name__ == "__main__":
    sys.exit(main())
