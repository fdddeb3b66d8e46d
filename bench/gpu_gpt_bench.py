"""A GPT trained on one GPU: zerocore stages 1-3 against FSDP2 and plain torch,
and the largest GPT each trains with its optimizer offloaded to the host.

    python bench/gpu_gpt_bench.py                    # throughput: ~1.3B params, bf16
    python bench/gpu_gpt_bench.py --mode offload     # the largest model with offload
    python bench/gpu_gpt_bench.py --breakdown --profile traces   # + per-phase times, a profile summary
    python bench/gpu_gpt_bench.py --zero-config '{"prefetch_bytes": 0}'  # zerocore.Config fields for zero1..3
    python bench/gpu_gpt_bench.py --dry-run          # plan, imports, params; no GPU needed
    python bench/gpu_gpt_bench.py --device cpu --layers 2 --d-model 64 --heads 2 --seq-len 32 --batch 2
                                                     # the same code end to end on the CPU (gloo)

The model is zerocore.examples.gpt (pre-LayerNorm blocks in an nn.ModuleList,
tied embedding), 26 x 2048 by default: 1.31B params. Each configuration
runs in a process of its own at world size 1 (on CUDA over a
"cpu:gloo,cuda:nccl" group, the control plane's and the data plane's):

    torch      the model in fp32, torch.autocast(bf16), AdamW(fused=True)
    fsdp2      fully_shard per block and on the root, MixedPrecisionPolicy
               (bf16 params, fp32 reduction), AdamW(fused=True)
    zero1..3   zerocore.wrap(model, AdamW, Config(stage=s, dtype="bf16"))

Throughput: tokens a second over --steps after --warmup (the median step),
TFLOPS as (6N + 12 L d T) flops a token (N params, L layers, d width, T
tokens a sequence) against the device's measured bf16 matmul rate, and the
peak device memory in use (total less free, which counts every allocator:
torch's caching allocator and zerocore's arenas alike) above what the
process held after start-up. Targets (issue 21): each zerocore stage at
least FSDP2's throughput at no more memory; zero3 within 5% of plain torch.

Offload: zero3 with offload_optimizer and offload_params ("cpu") against
FSDP2 with CPUOffloadPolicy, both built on the meta device. Layers double
from --layers until a size fails (out of memory) or --budget seconds are
spent, then bisect; the largest that trains --steps steps is reported with
its TFLOPS. Target: zerocore's largest model is larger than FSDP2's, at 40%
or more of the matmul rate. A search cut short by the budget says so.

Where the time goes, per config (in offload mode, of the largest model):
--breakdown prints each phase's median host and GPU time (gpu_phases.py)
and, for zero3, its hooks, native calls and rounds
(step_breakdown.StepBreakdown.instrument; its timers add a perf_counter
pair per hook and native call to the timed steps). --profile DIR runs two
more steps after the timed ones (the profiler's own overhead stays out of
them) under torch.profiler and prints a summary (gpu_profile.py: GPU busy
against wall time, the largest idle gaps and the host op during each, host
syncs); the gzip chrome trace goes to DIR when small.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_phases import DevicePhases, phase_table  # noqa: E402
from gpu_profile import format_summary, profile_steps  # noqa: E402
from step_breakdown import StepBreakdown, stage3_lines, stage3_schedule  # noqa: E402
import _harness as harness  # noqa: E402
from _memory import rss_kb  # noqa: E402

THROUGHPUT_CONFIGS = ("torch", "fsdp2", "zero1", "zero2", "zero3")
OFFLOAD_CONFIGS = ("zero3-offload", "fsdp2-offload")


def parse_args(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--mode", default="throughput", choices=("throughput", "offload"))
    p.add_argument("--configs", default=None, help="comma-separated subset of the mode's configs (default: all)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--layers", type=int, default=26,
                   help="throughput: the model's layers; offload: the first size tried")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences a step")
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--budget", type=float, default=240.0, help="offload: seconds the size search may take per config")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take before it is killed")
    p.add_argument("--zero-config", default="{}", type=json.loads,
                   help="JSON object: more zerocore.Config fields for the zero configs")
    p.add_argument("--breakdown", action="store_true", help="per-phase host and GPU times; zero3's hooks")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="profile two more steps: print a summary, keep the gzip trace in DIR when small")
    p.add_argument("--json", default=None, help="also write all results to this file")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the model's size; run nothing")
    args = p.parse_args(argv)
    if not isinstance(args.zero_config, dict):
        p.error("--zero-config must be a JSON object")
    return args


def gpt_config(args, layers: int):
    from zerocore.examples.gpt import GPTConfig

    return GPTConfig(vocab=256, n_layer=layers, n_head=args.heads, d_model=args.d_model, seq_len=args.seq_len)


def count_params(cfg) -> int:
    import torch

    from zerocore.examples.gpt import GPT

    with torch.device("meta"):
        return GPT(cfg).num_params()


def flops_per_token(params: int, cfg) -> float:
    return 6.0 * params + 12.0 * cfg.n_layer * cfg.d_model * cfg.seq_len


# ------------------------------------------------------------------ one run


class DeviceMemory:
    """Peak memory in use above the baseline at construction, sampled after
    each phase: on CUDA total less free (every allocator's), on the CPU RSS."""

    def __init__(self, device):
        self.device = device
        self.base = self.peak = self._used()

    def _used(self) -> int:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            return total - free
        return rss_kb() * 1024

    def sample(self):
        self.peak = max(self.peak, self._used())

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def _reset_modules(model):
    """Each module's own initialisation (FSDP2's params are DTensors, which
    the GPT's whole-model init cannot fill)."""
    import torch.nn as nn

    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding, nn.LayerNorm)):
            m.reset_parameters()


def _adamw(params, device):
    import torch

    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")


def build(name: str, cfg, device, mark=lambda phase: None, zero_config=None):
    """(step(x, y) -> loss, params, the zerocore engine or None) for config
    `name`; each step calls mark(phase) after each phase (gpu_phases.PHASES)."""
    import torch

    from zerocore.examples.gpt import GPT

    if name.startswith("zero"):
        import zerocore

        offload = name.endswith("-offload")
        if offload:
            with zerocore.init():
                model = GPT(cfg)
        else:
            with torch.device(device):
                model = GPT(cfg)
        params = model.num_params()
        extra = {"offload_optimizer": "cpu", "offload_params": "cpu"} if offload else {}
        # A meta model (offload) is materialised where it trains, each part where the Config keeps it.
        engine = zerocore.wrap(model, _adamw(model.parameters(), torch.device("cpu") if offload else device),
                               zerocore.Config(stage=int(name[4]), dtype="bf16", **extra, **(zero_config or {})),
                               device=device if offload else None)

        def step(x, y):
            loss = engine(x, y)["loss"]
            mark("fwd")
            engine.backward(loss)
            mark("bwd")
            engine.step()
            mark("opt")
            engine.zero_grad()
            mark("zero_grad")
            return loss
        return step, params, engine
    if name == "torch":
        with torch.device(device):
            model = GPT(cfg)
        return (harness.torch_step(model, _adamw(model.parameters(), device), mark, device.type, torch.bfloat16),
                model.num_params(), None)
    if name.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        offload = name.endswith("-offload")
        with torch.device("meta"):
            model = GPT(cfg)
        params = model.num_params()
        kw = {"mesh": init_device_mesh(device.type, (1,)),
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        if offload:
            kw["offload_policy"] = CPUOffloadPolicy()
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        model.to_empty(device="cpu" if offload else device)  # CPUOffloadPolicy keeps the shards on the host
        _reset_modules(model)
        opt = _adamw(model.parameters(), torch.device("cpu") if offload else device)
        return harness.torch_step(model, opt, mark), params, None  # its policy casts
    raise SystemExit(f"unknown config {name!r}")


def matmul_tflops(device) -> float:
    """The device's dense matmul rate: bf16 on CUDA, fp32 on the CPU."""
    import torch

    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = []
    for _ in range(8):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times[2:]) / 1e12


def worker(args) -> None:
    from datetime import timedelta

    import torch

    from zerocore.examples.gpt import TextData

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    if args.worker == "matmul":
        harness.send_result({"tflops": matmul_tflops(device)})
        return
    dist = harness.init_group(args, 1, "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                              timeout=timedelta(seconds=args.timeout))
    memory = DeviceMemory(device)
    cfg = gpt_config(args, args.layers)
    host, gpu = (StepBreakdown(), DevicePhases(device)) if args.breakdown else (None, None)

    def mark(phase):
        if host:
            host.phase(phase)
            gpu.phase(phase)

    step, params, engine = build(args.worker, cfg, device, mark, args.zero_config)
    instrument_error = None
    if host and engine is not None and stage3_schedule(engine) is not None:
        try:
            host.instrument(engine)
        except Exception as e:  # written against the CPU engine: a CUDA engine may differ, the phases still count
            instrument_error = repr(e)
    memory.sample()
    data, _ = TextData.from_corpus(args.seq_len, args.batch, seed=0)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        x, y = (t.to(device) for t in data.batch(i, 0, 1))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if host:
            host.begin()
            gpu.begin()
        t0 = time.perf_counter()
        loss = step(x, y)
        losses.append(float(loss.detach()))  # waits for the step's device work
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        if host:
            host.phase("wait")
            host.end()
            gpu.end()
        memory.sample()
    result = {"config": args.worker, "layers": args.layers, "params": params, "median_s": statistics.median(times),
              "memory_mb": memory.growth_mb, "losses": losses}
    if host:
        for figures, device_figures in zip(host.steps, gpu.seconds()):
            figures.update(device_figures)
        result["breakdown"] = host.medians(args.warmup)
        result["instrument_error"] = instrument_error
    if args.profile:
        def profiled(i):
            x, y = (t.to(device) for t in data.batch(args.warmup + args.steps + i, 0, 1))
            float(step(x, y).detach())

        try:
            result["profile"] = profile_steps(profiled, 2, device, args.profile, f"{args.worker}-{args.layers}L")
        except Exception as e:  # the profile is an extra: the throughput figures above stand without it
            result["profile"] = {"error": repr(e)}
    dist.destroy_process_group()
    harness.send_result(result)


# ------------------------------------------------------------------ driver


def run(args, name: str, layers: int) -> dict:
    command = harness.worker_command(__file__, name) + [
        "--device", args.device, "--layers", str(layers), "--d-model", str(args.d_model),
        "--heads", str(args.heads), "--seq-len", str(args.seq_len), "--batch", str(args.batch),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--timeout", str(args.timeout),
        "--zero-config", json.dumps(args.zero_config)] + (["--breakdown"] if args.breakdown else []) + \
        (["--profile", os.path.abspath(args.profile)] if args.profile else [])
    (result,) = harness.run_ranks(f"{name} ({layers} layers)", command, 1, args.timeout)
    result["tflops"] = flops_per_token(result["params"], gpt_config(args, layers)) * args.batch * args.seq_len / \
        result["median_s"] / 1e12
    return result


def report(r: dict) -> None:
    """A run's --breakdown and --profile figures, if it has them."""
    lines = []
    if "breakdown" in r:
        lines += phase_table(r["breakdown"]) + ["  " + line for line in stage3_lines(r["breakdown"])]
        if r["instrument_error"]:
            lines.append(f"  zero3's hooks not timed: {r['instrument_error']}")
    if "profile" in r and "error" in r["profile"]:
        lines.append(f"  profile failed: {r['profile']['error']}")
    elif "profile" in r:
        lines += ["  " + line for line in format_summary(r["profile"])] + [f"    trace: {r['profile']['trace']}"]
    for line in lines:
        print("    " + line, flush=True)


def largest(args, name: str) -> tuple:
    """(the largest run that trained, whether the budget cut the search short):
    layers double from --layers until one fails, then bisect."""
    deadline = time.monotonic() + args.budget
    best, failed = None, None
    layers = args.layers
    while time.monotonic() < deadline:
        try:
            best = run(args, name, layers)
            print(f"  {name:<14} {layers:4d} layers {best['params'] / 1e9:7.2f}B params: trains, "
                  f"{best['tflops']:.1f} TFLOPS", flush=True)
        except RuntimeError as e:
            failed = layers
            print(f"  {name:<14} {layers:4d} layers: fails ({str(e).splitlines()[-1][:120]})", flush=True)
        low = best["layers"] if best else 0
        if failed is None:
            layers *= 2
        elif failed - low <= 1:
            return best, False
        else:
            layers = (low + failed) // 2
    return best, True


def drive(args) -> int:
    known = THROUGHPUT_CONFIGS if args.mode == "throughput" else OFFLOAD_CONFIGS
    names = harness.config_names(args.configs or ",".join(known), known)
    cfg = gpt_config(args, args.layers)
    print(f"gpu_gpt_bench: {args.mode} on {args.device}, GPT {cfg.n_layer} x {cfg.d_model} "
          f"({count_params(cfg) / 1e9:.2f}B params), heads {cfg.n_head}, seq {cfg.seq_len}, batch {args.batch}, "
          f"bf16, configs {', '.join(names)}", flush=True)
    if args.dry_run:
        for module in ("zerocore", "torch.distributed.fsdp", "torch.profiler"):  # what the runs import
            importlib.import_module(module)
        importlib.import_module("zerocore").Config(stage=3, dtype="bf16", **args.zero_config)  # its fields exist
        print(f"dry run: nothing ran (breakdown {'on' if args.breakdown else 'off'}, profile to {args.profile}, "
              f"zero config {json.dumps(args.zero_config)})")
        return 0
    (peak,) = harness.run_ranks("matmul", harness.worker_command(__file__, "matmul") + ["--device", args.device], 1,
                                args.timeout)
    print(f"  matmul rate: {peak['tflops']:.1f} TFLOPS ({'bf16' if args.device == 'cuda' else 'fp32'})")
    results, failed, cut = {}, {}, {}
    for name in names:
        try:
            if args.mode == "throughput":
                results[name] = run(args, name, args.layers)
                r = results[name]
                print(f"  {name:<8} {args.batch * args.seq_len / r['median_s']:10.0f} tokens/s "
                      f"{r['tflops']:7.1f} TFLOPS ({r['tflops'] / peak['tflops']:.0%} of matmul)  "
                      f"memory {r['memory_mb']:9.0f} MB  loss {r['losses'][-1]:.3f}", flush=True)
                report(r)
            else:
                results[name], cut[name] = largest(args, name)
                if results[name] is None:
                    failed[name] = f"not even {args.layers} layers trained"
                else:
                    report(results[name])
        except RuntimeError as e:
            failed[name] = str(e)
            print(f"  {name:<8} FAILED: {e}", flush=True)
    results = {k: v for k, v in results.items() if v is not None}

    print("\ntargets")

    def check(label, ok):
        print(f"  {label:<60} {'PASS' if ok else 'MISS'}")

    if args.mode == "throughput":
        f = results.get("fsdp2")
        for name in ("zero1", "zero2", "zero3"):
            z = results.get(name)
            if z and f:
                check(f"{name} / fsdp2 time {z['median_s'] / f['median_s']:.3f} (<= 1), memory "
                      f"{z['memory_mb'] / f['memory_mb']:.3f} (<= 1)",
                      z["median_s"] <= f["median_s"] and z["memory_mb"] <= f["memory_mb"])
        if "zero3" in results and "torch" in results:
            ratio = results["zero3"]["median_s"] / results["torch"]["median_s"]
            check(f"zero3 / torch time {ratio:.3f} (<= 1.05)", ratio <= 1.05)
    else:
        z, f = results.get("zero3-offload"), results.get("fsdp2-offload")
        for name, r in results.items():
            print(f"  {name}: largest {r['params'] / 1e9:.2f}B params ({r['layers']} layers)"
                  f"{' at least: the budget ended the search' if cut.get(name) else ''}, "
                  f"{r['tflops'] / peak['tflops']:.0%} of the matmul rate")
        if z and f:
            check(f"zero3-offload largest / fsdp2-offload largest {z['params'] / f['params']:.2f} (> 1)",
                  z["params"] > f["params"])
        if z:
            check(f"zero3-offload at {z['tflops'] / peak['tflops']:.0%} of the matmul rate (>= 40%)",
                  z["tflops"] >= 0.4 * peak["tflops"])
    return harness.finish(args, failed, {"matmul_tflops": peak["tflops"], "results": results})


def main(argv=None) -> int:
    return harness.dispatch(parse_args(argv), worker, drive)


if __name__ == "__main__":
    sys.exit(main())
