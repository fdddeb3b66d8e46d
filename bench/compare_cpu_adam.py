"""zerocore's CPU Adam against its peers, in one process, same sizes and threads.

    python3 bench/compare_cpu_adam.py [--params N] [--threads T] [--iters K]
                                      [--bench-binary build/bench/cpu_adam_bench]

Two updates of one flat fp32 partition (AdamW, lr 1e-3, weight decay 0.01):

  fp32     fp32 grad in, fp32 param / exp_avg / exp_avg_sq updated in place;
  offload  the ZeRO-Offload step: bf16 grad in, fp32 param and state
           updated, bf16 param copy out (what goes back to the GPU).

Contestants:

  zerocore     zerocore.ops.adam_, one pass for both updates; buffers from
               zerocore.empty (huge-page host arenas) viewed through
               zerocore.to_torch.
  torch-fused  torch.optim.AdamW(fused=True) on ordinary torch tensors. It
               needs a grad of the param's dtype, so the offload update is
               grad32.copy_(grad_bf16), step(), param_bf16.copy_(param): the
               passes a user of it has to pay for.
  deepspeed    DeepSpeedCPUAdam (adamw_mode) the same way, when
               `import deepspeed` works; skipped otherwise.

Stream reference: with --bench-binary (or $ZEROCORE_BENCH_BINARY), runs
`cpu_adam_bench --stream-only` at the same size and thread count, whose
"stream offload pattern" kernel has the offload update's access pattern
(28 B/param); a torch triad (12 B/param) is measured in-process either way.

Each contestant gets one untimed warm-up step (it also creates torch's lazy
state); then the K timed rounds interleave the contestants, so that a change
in machine load hits all of them alike, with a short pause before each timed
step (see SETTLE_S). Best-of-K times give the ratios.
"""

import os
import re
import resource
import statistics
import subprocess
import time

import torch

import _harness as harness
import zerocore

LR, WEIGHT_DECAY = 1e-3, 0.01
BYTES_PER_PARAM = 28  # both updates: read p, m, v, g and write p, m, v (+ copy)

# Targets from the issue.
STREAM_FRACTION_TARGET = 0.85  # offload update vs offload-pattern stream bandwidth
OFFLOAD_SPEEDUP_TARGET = 1.4  # offload update vs the fastest peer
FP32_SPEEDUP_TARGET = 1.0  # fp32 update vs the fastest peer


def parse_args():
    ap = harness.parser(__doc__, worker=False)
    ap.add_argument("--params", type=int, default=32 << 20)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--bench-binary", default=os.environ.get("ZEROCORE_BENCH_BINARY"))
    return ap.parse_args()


def fill_inputs(param, grad, exp_avg, exp_avg_sq):
    """Writes the same deterministic values into any set of buffers (this is
    also their first touch). Gradients in [0.01, 0.02]: no denormals."""
    n = param.numel()
    i = torch.arange(n, dtype=torch.float32)
    param.copy_(0.5 - torch.remainder(i, 89) / 89)
    g = 0.01 + 0.01 * torch.remainder(i, 97) / 97
    grad.copy_(g)
    exp_avg.copy_(0.1 * g)
    exp_avg_sq.copy_(0.01 * g * g)


class Zerocore:
    name = "zerocore"

    def __init__(self, n):
        def buf(dtype):
            return zerocore.to_torch(zerocore.empty([n], dtype))

        self.param, self.exp_avg, self.exp_avg_sq = buf("float32"), buf("float32"), buf("float32")
        self.grad32, self.grad16, self.copy16 = buf("float32"), buf("bfloat16"), buf("bfloat16")
        fill_inputs(self.param, self.grad32, self.exp_avg, self.exp_avg_sq)
        self.grad16.copy_(self.grad32)
        self.copy16.zero_()
        self.step_count = 0

    def step(self, offload):
        self.step_count += 1
        zerocore.ops.adam_(
            self.param, self.grad16 if offload else self.grad32, self.exp_avg, self.exp_avg_sq,
            step=self.step_count, lr=LR, weight_decay=WEIGHT_DECAY,
            param_copy=self.copy16 if offload else None)


class TorchStyle:
    """A torch.optim-style optimizer on one flat fp32 param; the offload
    update upcasts the bf16 grad first and copies the params down after."""

    def __init__(self, n, make_optimizer):
        self.param = torch.nn.Parameter(torch.empty(n))
        self.param.grad = torch.empty(n)
        exp_avg, exp_avg_sq = torch.empty(n), torch.empty(n)
        fill_inputs(self.param.data, self.param.grad, exp_avg, exp_avg_sq)
        self.grad16 = self.param.grad.to(torch.bfloat16)
        self.copy16 = torch.zeros(n, dtype=torch.bfloat16)
        self.opt = make_optimizer([self.param])
        self.opt.step()  # creates the lazy state; then start from the same values as zerocore
        state = self.opt.state[self.param]
        state["exp_avg"].copy_(exp_avg)
        state["exp_avg_sq"].copy_(exp_avg_sq)

    @torch.no_grad()
    def step(self, offload):
        if offload:
            self.param.grad.copy_(self.grad16)
        self.opt.step()
        if offload:
            self.copy16.copy_(self.param)


class TorchFused(TorchStyle):
    name = "torch-fused"

    def __init__(self, n):
        super().__init__(n, lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, fused=True))


def deepspeed_contestant():
    """The DeepSpeedCPUAdam class, or None with the reason it is skipped."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # not installed, or its CPU op does not build here
        return None, f"{type(e).__name__}: {e}"

    class DeepSpeed(TorchStyle):
        name = "deepspeed"

        def __init__(self, n):
            super().__init__(n, lambda ps: DeepSpeedCPUAdam(ps, lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=True))

    return DeepSpeed, None


# Pause before each timed step. torch's OpenMP (libgomp) workers spin for a
# few ms after each parallel region; a step that starts inside that window
# shares its CPUs with them (bench/RESULTS.md: a step right after a torch
# step runs slower, one 10 ms later, or at once with OMP_WAIT_POLICY=PASSIVE,
# does not).
SETTLE_S = 0.02


def time_interleaved(contestants, offload, iters):
    """Best and median seconds per contestant name."""
    for c in contestants:
        c.step(offload)  # warm-up
    seconds = {c.name: [] for c in contestants}
    for _ in range(iters):
        for c in contestants:
            time.sleep(SETTLE_S)
            t0 = time.perf_counter()
            c.step(offload)
            seconds[c.name].append(time.perf_counter() - t0)
    return {k: (min(v), statistics.median(v)) for k, v in seconds.items()}


def torch_triad_gbs(n, iters):
    a, b, c = torch.empty(n), torch.ones(n), torch.ones(n)
    torch.add(b, c, alpha=0.5, out=a)
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=0.5, out=a)
        best = min(best, time.perf_counter() - t0)
    return 12 * n / best / 1e9


def binary_stream_gbs(binary, n, threads, iters):
    """The offload-pattern stream bandwidth from cpu_adam_bench --stream-only."""
    out = subprocess.run(
        [binary, "--stream-only", "--params", str(n), "--threads", str(threads), "--iters", str(iters)],
        check=True, capture_output=True, text=True).stdout
    m = re.search(r"^stream offload pattern.*?([\d.]+)\s*$", out, re.M)
    if not m:
        raise RuntimeError(f"no stream offload line in the output of {binary}:\n{out}")
    return float(m.group(1)), out


def cpu_seconds():
    """(CPU-s the whole machine was busy, CPU-s this process used). Their
    difference over a measurement is what other processes took: on a shared
    machine, numbers taken while that is not ~0 understate the machine."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    r = resource.getrusage(resource.RUSAGE_SELF)
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), r.ru_utime + r.ru_stime


def verdict(ok):
    return "PASS" if ok else "MISS"


def main():
    args = parse_args()
    n = args.params
    torch.set_num_threads(args.threads)
    zerocore.set_num_threads(args.threads)
    features = zerocore.cpu_features()
    print(f"compare_cpu_adam: params={n} threads={args.threads} (torch {torch.get_num_threads()}, "
          f"zerocore {zerocore.num_threads()}) zerocore isa={features['isa']} torch {torch.__version__} "
          f"iters={args.iters}")

    # The stream references first, before this process holds its buffers.
    stream_gbs = None
    if args.bench_binary:
        stream_gbs, out = binary_stream_gbs(args.bench_binary, n, args.threads, args.iters)
        print("  " + "\n  ".join(out.strip().splitlines()))
    triad_gbs = torch_triad_gbs(n, args.iters)
    print(f"torch triad (12 B/param): {triad_gbs:.1f} GB/s")

    contestants = [Zerocore(n), TorchFused(n)]
    DeepSpeed, ds_skip = deepspeed_contestant()
    if DeepSpeed:
        contestants.append(DeepSpeed(n))
    else:
        print(f"deepspeed: skipped ({ds_skip})")

    (busy0, self0), wall0 = cpu_seconds(), time.perf_counter()
    results = {offload: time_interleaved(contestants, offload, args.iters) for offload in (False, True)}
    (busy1, self1), wall = cpu_seconds(), time.perf_counter() - wall0
    others = (busy1 - busy0) - (self1 - self0)

    # GB/s counts the update's 28 B/param for every contestant (the bytes the
    # work needs, not the extra passes a peer makes); "zerocore x" is the
    # peer's best time over zerocore's.
    print(f"\n{'update':<10}{'contestant':<13}{'best ms':>9}{'median ms':>11}{'Gparam/s':>10}{'GB/s':>8}"
          f"{'zerocore x':>12}")
    for offload, label in ((False, "fp32"), (True, "offload")):
        zc_best = results[offload]["zerocore"][0]
        for name, (best, median) in results[offload].items():
            speedup = "" if name == "zerocore" else f"{best / zc_best:.2f}"
            print(f"{label:<10}{name:<13}{best * 1e3:>9.2f}{median * 1e3:>11.2f}"
                  f"{n / best / 1e9:>10.3f}{BYTES_PER_PARAM * n / best / 1e9:>8.1f}{speedup:>12}")

    shared = " (machine shared: numbers are low)" if others > 0.02 * wall * args.threads else ""
    print(f"other processes: {others:.2f} CPU-s during the {wall:.1f} s measured{shared}")

    print("\ntargets (best-of-K times):")
    for offload, label, target in ((True, "offload", OFFLOAD_SPEEDUP_TARGET), (False, "fp32", FP32_SPEEDUP_TARGET)):
        r = results[offload]
        zc = r["zerocore"][0]
        peer = min((name for name in r if name != "zerocore"), key=lambda k: r[k][0])
        ratio = r[peer][0] / zc
        print(f"  {label}: zerocore / fastest peer ({peer}) = {ratio:.2f}x, target >= {target}x: "
              f"{verdict(ratio >= target)}")
    if stream_gbs:
        fraction = BYTES_PER_PARAM * n / results[True]["zerocore"][0] / 1e9 / stream_gbs
        print(f"  offload: zerocore / offload-pattern stream ({stream_gbs:.1f} GB/s) = {fraction:.2f}, "
              f"target >= {STREAM_FRACTION_TARGET}: {verdict(fraction >= STREAM_FRACTION_TARGET)}")
    else:
        print("  offload vs stream bandwidth: SKIP (give --bench-binary path/to/cpu_adam_bench)")


if __name__ == "__main__":
    main()
