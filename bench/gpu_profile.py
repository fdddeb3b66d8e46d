"""What the GPU did during profiled steps (gpu_gpt_bench.py --profile): a
summary computed from torch.profiler's chrome trace, so that a results file
holds the figures, not only a trace to open elsewhere.

- GPU busy: the union of the kernel, memcpy and memset intervals on the
  compute stream (the stream with the most kernel time: torch's current
  stream in these runs) against the steps' wall time (from the first step's
  start to the last one's end, each step ending in a device synchronize);
  the other streams' busy time beside it (comm and copy streams).
- The largest idle gaps of the compute stream within the steps, each with
  the host op most active during it: of the CPU ops, annotations and CUDA
  runtime calls of any thread that overlap the gap, the shortest of those
  covering at least 90% of the largest overlap (the innermost op that
  spans the gap, not the step around it).
- Host synchronisation: the count and total time of the
  cudaEventSynchronize, cudaStreamSynchronize and cudaDeviceSynchronize
  calls.

The interval functions take plain (start, end) pairs, and summarize() the
trace's event list, so tests run them on the CPU with made-up events.
"""
from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections import defaultdict

STEP_MARK = "gpu_gpt_bench.step"  # the record_function around each profiled step
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
SYNC_CALLS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")
TRACE_LIMIT_BYTES = 16 * 2**20  # larger gzip traces are not kept


def merge(intervals) -> list:
    """The union of (start, end) intervals as sorted, disjoint intervals."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [tuple(i) for i in out]


def union_length(intervals) -> float:
    return sum(end - start for start, end in merge(intervals))


def gaps(intervals, start: float, end: float) -> list:
    """The parts of [start, end] that no interval covers, in order."""
    out, at = [], start
    for s, e in merge(intervals):
        if s > at:
            out.append((at, min(s, end)))
        at = max(at, e)
        if at >= end:
            break
    if at < end:
        out.append((at, end))
    return [g for g in out if g[1] > g[0]]


def largest_gaps(intervals, start: float, end: float, n: int = 10) -> list:
    """The n longest gaps (see gaps), longest first."""
    return sorted(gaps(intervals, start, end), key=lambda g: g[0] - g[1])[:n]


def op_during(ops, gap):
    """The (start, end, name) of `ops` most active during `gap` (see the
    module's doc), or None when none overlaps it."""
    def overlap(op):
        return min(op[1], gap[1]) - max(op[0], gap[0])

    touching = [op for op in ops if overlap(op) > 0]
    if not touching:
        return None
    most = max(overlap(op) for op in touching)
    return min((op for op in touching if overlap(op) >= 0.9 * most), key=lambda op: op[1] - op[0])


def summarize(events, n_gaps: int = 10) -> dict:
    """The summary of a chrome trace's complete events (dicts with ph, cat,
    name, ts and dur in microseconds, args.stream on GPU events) between the
    first and last STEP_MARK annotation. Times in the result are in ms."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in complete
             if e.get("cat") == "user_annotation" and e.get("name") == STEP_MARK]
    if not steps:
        raise ValueError(f"no {STEP_MARK!r} annotation in the trace")
    start, end = min(s for s, _ in steps), max(e for _, e in steps)

    def inside(e):
        return e["ts"] < end and e["ts"] + e["dur"] > start

    by_stream = defaultdict(list)
    for e in complete:
        if e.get("cat") in GPU_CATEGORIES and inside(e):
            by_stream[e.get("args", {}).get("stream")].append((max(e["ts"], start), min(e["ts"] + e["dur"], end)))
    kernel_time = defaultdict(float)
    for e in complete:
        if e.get("cat") == "kernel" and inside(e):
            kernel_time[e.get("args", {}).get("stream")] += e["dur"]
    ops = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in complete
           if e.get("cat") in HOST_CATEGORIES and e.get("name") != STEP_MARK and inside(e)]
    syncs = defaultdict(lambda: {"count": 0, "ms": 0.0})
    for e in complete:
        name = next((s for s in SYNC_CALLS if e.get("name", "").startswith(s)), None)
        if name and e.get("cat") == "cuda_runtime" and inside(e):
            syncs[name]["count"] += 1
            syncs[name]["ms"] += e["dur"] / 1e3

    summary = {"steps": len(steps), "wall_ms": (end - start) / 1e3, "compute_stream": None, "busy_ms": 0.0,
               "streams": {str(s): union_length(iv) / 1e3 for s, iv in by_stream.items()}, "gaps": [],
               "syncs": {name: syncs[name] for name in SYNC_CALLS}}
    if kernel_time:
        stream = max(kernel_time, key=kernel_time.get)
        busy = by_stream[stream]
        summary.update(compute_stream=str(stream), busy_ms=union_length(busy) / 1e3)
        for g in largest_gaps(busy, start, end, n_gaps):
            op = op_during(ops, g)
            summary["gaps"].append({"at_ms": (g[0] - start) / 1e3, "ms": (g[1] - g[0]) / 1e3,
                                    "op": op[2] if op else None, "op_ms": (op[1] - op[0]) / 1e3 if op else None})
    return summary


def format_summary(s: dict) -> list:
    """The summary's lines, for the bench's report."""
    lines = [f"profile: {s['steps']} steps, wall {s['wall_ms']:.1f} ms"]
    if s["compute_stream"] is None:
        lines.append("  no GPU kernels in the trace")
    else:
        lines.append(f"  GPU busy on the compute stream ({s['compute_stream']}): {s['busy_ms']:.1f} ms, "
                     f"{s['busy_ms'] / s['wall_ms']:.0%} of the wall time; idle {s['wall_ms'] - s['busy_ms']:.1f} ms")
        others = {k: v for k, v in s["streams"].items() if k != s["compute_stream"]}
        if others:
            lines.append("  other streams busy, ms: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(others.items())))
        lines.append("  largest idle gaps on the compute stream (at ms from the start: ms, the host op during it):")
        for g in s["gaps"]:
            op = f"{g['op'][:80]} ({g['op_ms']:.2f} ms)" if g["op"] else "no host op"
            lines.append(f"    at {g['at_ms']:8.2f}: {g['ms']:7.3f} ms  {op}")
    syncs = ", ".join(f"{name} x{v['count']} {v['ms']:.1f} ms" for name, v in s["syncs"].items())
    lines.append(f"  host syncs: {syncs}")
    return lines


def profile_steps(run_step, steps: int, device, out_dir: str, label: str) -> dict:
    """Runs run_step(i) for i in range(steps) under torch.profiler (CPU, and
    CUDA on a GPU; no stacks or shapes); returns summarize()'s summary, with
    "trace": the gzip chrome trace kept under out_dir, or why none was."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(steps):
            with record_function(STEP_MARK):
                run_step(i)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as f:
            raw = f.read()
    summary = summarize(json.loads(raw)["traceEvents"])
    packed = gzip.compress(raw)
    if len(packed) < TRACE_LIMIT_BYTES:
        os.makedirs(out_dir, exist_ok=True)
        summary["trace"] = os.path.join(out_dir, f"{label}.json.gz")
        with open(summary["trace"], "wb") as f:
            f.write(packed)
    else:
        summary["trace"] = f"not kept: {len(packed) / 2**20:.0f} MB gzip"
    return summary
