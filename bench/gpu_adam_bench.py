"""The fused CUDA AdamW update (zerocore.cuda.adam_) against the device's
copy bandwidth and against torch.optim.AdamW(fused=True) plus the 16-bit
cast its user needs, on one GPU, in the same run.

    python bench/gpu_adam_bench.py              # 2**28 params
    python bench/gpu_adam_bench.py --numel 67108864
    python bench/gpu_adam_bench.py --dry-run    # imports and arguments only; no GPU needed

zerocore's update reads fp32 params and moments and bf16 grads and writes
fp32 params, moments and a bf16 copy of the params in one pass: 28 bytes a
param. Its bandwidth (those bytes over its time) is compared with a
device-to-device copy's (bytes read and written over its time). The peer
is torch's fused AdamW on fp32 params with fp32 grads (its fused kernel
takes grads of the params' dtype, so a bf16 grad is cast first, timed with
it) followed by the bf16 copy of the params. Times are CUDA-event medians
of --iters after --warmup.

Targets (issue 9): bandwidth at least 0.85 of the copy's; at least 1.2x
torch's time. Each prints PASS or MISS.
"""
from __future__ import annotations

import statistics

import _harness as harness


def _median_ms(fn, iters, warmup):
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None):
    p = harness.parser(__doc__, worker=False)
    p.add_argument("--numel", type=int, default=1 << 28, help="params updated")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dry-run", action="store_true", help="import what the run needs; run nothing")
    args = p.parse_args(argv)
    import torch

    import zerocore.cuda

    if args.dry_run:
        print(f"gpu_adam_bench: {args.numel:,} params, {args.iters} iterations after {args.warmup}; "
              f"dry run: nothing ran")
        return
    n, dev = args.numel, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    param = torch.randn(n, device=dev, generator=g)
    grad = torch.randn(n, device=dev, generator=g).bfloat16()
    m, v = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    copy = torch.empty(n, device=dev, dtype=torch.bfloat16)
    step = [0]

    def fused():
        step[0] += 1
        zerocore.cuda.adam_(param, grad, m, v, step=step[0], lr=1e-4, weight_decay=0.1, param_copy=copy)

    ours = _median_ms(fused, args.iters, args.warmup)
    src_dst = [torch.empty(7 * n, device=dev, dtype=torch.float32), torch.empty(7 * n, device=dev)]
    copy_ms = _median_ms(lambda: src_dst[1].copy_(src_dst[0]), args.iters, args.warmup)
    src_dst.clear()  # their 56n bytes go before the peer allocates its own

    tp = torch.nn.Parameter(param.clone())
    opt = torch.optim.AdamW([tp], lr=1e-4, weight_decay=0.1, fused=True)

    def peer():
        tp.grad = grad.float()
        opt.step()
        copy.copy_(tp)

    torch_ms = _median_ms(peer, args.iters, args.warmup)
    ours_bw = 28 * n / ours / 1e6  # GB/s
    copy_bw = 2 * 28 * n / copy_ms / 1e6  # the copy moves 28 bytes a param each way
    print(f"{torch.cuda.get_device_name()}: {n:,} params, bf16 grads and copy, fp32 state")
    print(f"  zerocore fused AdamW  {ours:8.3f} ms  {ours_bw:8.1f} GB/s")
    print(f"  device copy           {copy_ms:8.3f} ms  {copy_bw:8.1f} GB/s (read + written)")
    print(f"  torch AdamW(fused) + cast  {torch_ms:8.3f} ms")
    print(f"  bandwidth / copy's: {ours_bw / copy_bw:.3f} (>= 0.85 {'PASS' if ours_bw >= 0.85 * copy_bw else 'MISS'}); "
          f"torch / zerocore time: {torch_ms / ours:.3f} (>= 1.2 {'PASS' if torch_ms >= 1.2 * ours else 'MISS'})")


if __name__ == "__main__":
    main()
