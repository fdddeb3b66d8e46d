"""Host-overhead benchmark: a latency-bound step, where what counts is how
many collectives and how much host work a step costs, not bandwidth.

    python bench/host_overhead_bench.py                  # all configs, 3 repeats
    python bench/host_overhead_bench.py --configs zero3,ds3 --repeats 5

Model: 8 blocks of Linear(256, 256) + GELU in an nn.Sequential (0.5M params),
batch 16 a rank, fp32 AdamW, on 2 gloo CPU ranks with torch threads 1.
Configurations (each in fresh processes, one per rank, interleaved over
--repeats so a noisy neighbour hits them alike):

    zero2, zero3  zerocore.wrap(model, AdamW, Config(stage=s)), defaults
    ddp           torch DistributedDataParallel + torch.optim.AdamW
    fsdp2         fully_shard per block and on the root + torch.optim.AdamW
    ds2, ds3      DeepSpeed ZeRO-2 / ZeRO-3 (DS_ACCELERATOR=cpu, gloo), its
                  defaults, torch.optim.AdamW as the client optimizer;
                  deepspeed is imported in these configs' processes only

Step time: the median over the timed steps (each from a barrier, the
slower rank's), the lowest over repeats. For zerocore it also prints the
collectives a step issues: data-plane collectives (gathers, reductions;
the queue's trace), stage 3's rounds and the step's one control exchange.
For DeepSpeed, the calls of torch.distributed's collective functions in a
timed step (count_collectives wraps them in those processes before
DeepSpeed binds them; a call inside another, as all_gather_object's
gathers, counts once, as the outer call), by function.

Targets (issue 20, "Fewer, larger collectives"): zero3 at most ds3's step
time; zero2 at most 1.1x ddp's. Each prints PASS or MISS.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from collections import Counter

import _harness as harness

CONFIGS = ("zero2", "zero3", "ddp", "fsdp2", "ds2", "ds3")
TORCH_CALLS = Counter()  # DeepSpeed's configs: torch.distributed's collective calls (count_collectives)
TARGETS = (("zero3", "ds3", 1.0), ("zero2", "ddp", 1.1))


def parse_args(argv=None):
    p = harness.parser(__doc__, CONFIGS)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="rows a rank")
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration run")
    return p.parse_args(argv)


# ------------------------------------------------------------------ one rank


def torch_step(forward, opt, loss_of):
    """A plain torch training step (DDP's and FSDP2's): forward, backward, update."""
    def step(x):
        loss = loss_of(forward(x))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


# torch.distributed's collective functions (and point-to-point calls), as
# DeepSpeed's comm layer calls them.
TORCH_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "_all_gather_base",
                     "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
                     "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier",
                     "all_gather_object", "broadcast_object_list", "send", "recv", "isend", "irecv",
                     "batch_isend_irecv")


def count_collectives(counts) -> None:
    """Each call of a function of TORCH_COLLECTIVES, from now on, adds 1 to
    counts[its name] (a Counter), where it was not called from inside
    another: wraps them in torch.distributed and its distributed_c10d module,
    so call it before anything takes references to them."""
    import functools

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    depth = [0]
    for name in TORCH_COLLECTIVES:
        fn = getattr(c10d, name, None)
        if fn is None:
            continue

        @functools.wraps(fn)
        def counted(*args, _fn=fn, _name=name, **kwargs):
            if depth[0] == 0:
                counts[_name] += 1
            depth[0] += 1
            try:
                return _fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        for module in (dist, c10d):
            if getattr(module, name, None) is fn:
                setattr(module, name, counted)


def build(name, model, rank, world):
    """(step(x) -> loss, collectives() -> dict or None, close()) for
    configuration `name`."""
    import torch

    def mse(out):
        return out.square().mean()

    if name.startswith("zero"):
        import zerocore

        zerocore.set_num_threads(1)
        engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               zerocore.Config(stage=int(name[4:])))
        schedule = getattr(engine.parts.scheduler, "native", None)
        counts = {}

        def step(x):
            rounds = schedule.rounds if schedule else 0
            waited = schedule.round_seconds if schedule else 0.0
            loss = mse(engine(x))
            engine.backward(loss)
            # The queue's trace restarts at the step's order check: just
            # before it, it holds every data-plane collective since the last.
            counts["data"] = len(engine.parts.comm.trace)
            engine.step()
            engine.zero_grad()
            counts["rounds"] = (schedule.rounds - rounds) if schedule else 0
            # What the rounds cost the training thread: its waits for them to settle (control plane, host flags).
            counts["round_ms"] = 1000 * (schedule.round_seconds - waited) if schedule else 0.0
            return loss

        # Closed before the process group goes, so no queue thread outlives it.
        return step, lambda: dict(counts, control=1), engine.close
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp, opt = DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-3)

        return torch_step(ddp, opt, mse), lambda: None, lambda: None
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        return torch_step(model, opt, mse), lambda: None, lambda: None
    if name in ("ds2", "ds3"):
        import deepspeed  # a bench dependency, of these configurations alone

        ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                     "zero_optimization": {"stage": int(name[2:])}, "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                          config=ds_config)
        calls, counts = TORCH_CALLS, {}

        def step(x):
            calls.clear()
            loss = mse(engine(x))
            engine.backward(loss)
            engine.step()
            counts.clear()
            counts.update(calls, total=sum(calls.values()))
            return loss

        return step, lambda: dict(counts), lambda: None
    raise SystemExit(f"unknown config {name!r}; use one of {', '.join(CONFIGS)}")


def worker(args) -> None:
    from datetime import timedelta

    name, rank, world = args.worker, args.rank, 2
    if name.startswith("ds"):
        os.environ.update(DS_ACCELERATOR="cpu", **harness.launcher_env(args, world))
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    if name.startswith("ds"):
        count_collectives(TORCH_CALLS)  # before DeepSpeed binds torch.distributed's functions
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=args.timeout))
    else:
        harness.init_group(args, world, timeout=timedelta(seconds=args.timeout))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.GELU())
                            for _ in range(args.blocks)])
    step, collectives, close = build(name, model, rank, world)
    gen = torch.Generator().manual_seed(1 + rank)
    times = []
    for i in range(args.warmup + args.steps):
        x = torch.randn(args.batch, args.width, generator=gen)
        dist.barrier()
        t0 = time.perf_counter()
        step(x)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    result = {"median_s": statistics.median(times), "collectives": collectives()}
    close()
    dist.barrier()
    harness.send_result(result)
    if name.startswith("ds"):
        os._exit(0)  # DeepSpeed 0.19's threads abort the interpreter's teardown (terminate, no active exception)
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver


def run_config(args, name) -> dict:
    """One run of `name` on 2 fresh processes: the slower rank's median step
    and rank 0's collective counts."""
    cmd = harness.worker_command(__file__, name) + [
        "--blocks", str(args.blocks), "--width", str(args.width), "--batch", str(args.batch),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--timeout", str(args.timeout)]
    ranks = harness.run_ranks(name, cmd, 2, args.timeout, env={"OMP_NUM_THREADS": "1"})
    return {"median_s": max(r["median_s"] for r in ranks), "collectives": ranks[0]["collectives"]}


def describe_collectives(c: dict) -> str:
    """A config's collectives a step: zerocore's by plane, DeepSpeed's by torch.distributed function."""
    if "data" in c:
        waits = f" (the host waited {c['round_ms']:.2f} ms for them)" if c["rounds"] else ""
        return f"{c['data']} data, {c['rounds']} rounds{waits}, {c['control']} control"
    calls = ", ".join(f"{n} {k}" for k, n in sorted(c.items()) if k != "total")
    return f"{c['total']} torch.distributed calls ({calls})"


def drive(args) -> int:
    names = harness.config_names(args.configs, CONFIGS)
    print(f"host_overhead_bench: 2 CPU ranks (gloo), torch threads 1, {args.blocks} x (Linear({args.width}, "
          f"{args.width}) + GELU), batch {args.batch} a rank, fp32 AdamW, {args.steps} timed steps after "
          f"{args.warmup}, {os.cpu_count()} cores", flush=True)

    def show(rep, name, res):
        counts = f"   collectives a step: {describe_collectives(res['collectives'])}" if res["collectives"] else ""
        print(f"  [{rep + 1}/{args.repeats}] {name:<6} median step {res['median_s'] * 1e3:7.1f} ms{counts}", flush=True)

    runs, failed = harness.run_interleaved(names, args.repeats, lambda name: run_config(args, name), show)
    best = {n: min(r["median_s"] for r in rs) for n, rs in runs.items()}
    print("\nstep time, ms (lowest median over repeats)")
    for name in names:
        if name in best:
            print(f"  {name:<6} {best[name] * 1e3:7.1f}")
    print("\nratios")
    ratios = harness.Ratios(best)
    for a, b, limit in TARGETS:
        ratios.target(f"{a} / {b} step time", a, b, limit)
    for a, b in (("zero3", "fsdp2"), ("zero2", "ds2")):
        ratios.info(f"{a} / {b} step time", a, b)
    status = harness.finish(args, failed, {"runs": runs})
    return status or int(ratios.missed)


def main(argv=None) -> int:
    return harness.dispatch(parse_args(argv), worker, drive)


if __name__ == "__main__":
    sys.exit(main())
