"""The GPU bench's analysis, on the CPU: the interval arithmetic and the
profile summary of bench/gpu_profile.py on made-up trace events, the phase
table of bench/gpu_phases.py, and bench/gpu_gpt_bench.py --breakdown
--profile end to end on a tiny GPT (no CUDA events or kernels there)."""
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

from gpu_phases import phase_table  # noqa: E402
from gpu_profile import STEP_MARK, format_summary, gaps, largest_gaps, merge, op_during, summarize, union_length  # noqa


def test_union_merges_overlapping_and_touching_intervals():
    assert merge([(5, 7), (0, 2), (1, 3), (3, 4), (10, 11)]) == [(0, 4), (5, 7), (10, 11)]
    assert union_length([(0, 2), (1, 3), (5, 7)]) == 5
    assert union_length([]) == 0


def test_gaps_within_a_window_clip_intervals_outside_it():
    busy = [(-5, 1), (2, 3), (2.5, 6), (8, 20)]
    assert gaps(busy, 0, 10) == [(1, 2), (6, 8)]
    assert gaps([], 0, 10) == [(0, 10)]
    assert gaps([(3, 4)], 0, 10) == [(0, 3), (4, 10)]
    assert largest_gaps([(1, 2), (5, 6), (7, 9)], 0, 10, n=2) == [(2, 5), (0, 1)]


def test_the_op_during_a_gap_is_the_innermost_that_spans_it():
    ops = [(0, 100, "step"), (10, 30, "backward"), (12, 29, "wait"), (20, 21, "tiny")]
    assert op_during(ops, (12, 29))[2] == "wait"
    assert op_during(ops, (40, 50))[2] == "step"
    assert op_during(ops, (200, 300)) is None


def _event(cat, name, ts, dur, stream=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 0}
    if stream is not None:
        e["args"] = {"stream": stream}
    return e


def test_summary_of_a_made_up_trace():
    events = [
        _event("user_annotation", STEP_MARK, 0, 1000),
        _event("user_annotation", STEP_MARK, 1100, 900),  # the steps span 0-2000 us
        _event("kernel", "gemm", 100, 400, stream=7),
        _event("kernel", "gemm", 300, 300, stream=7),  # overlaps the first: busy 100-600
        _event("gpu_memcpy", "Memcpy HtoD", 1200, 300, stream=7),
        _event("kernel", "nccl", 0, 1500, stream=20),  # one long kernel, less kernel time than stream 7's 1600 us
        _event("kernel", "gemm", 1600, 300, stream=7),
        _event("kernel", "gemm", 1900, 600, stream=7),  # clipped at the steps' end
        _event("kernel", "late", 5000, 10, stream=7),  # after the steps: left out
        _event("cpu_op", "aten::mm", 550, 100),
        _event("cuda_runtime", "cudaStreamSynchronize", 620, 570),  # the host waits in the 600-1200 gap
        _event("cuda_runtime", "cudaEventSynchronize", 1950, 10),
        _event("cpu_op", "outside", 3000, 10),
        {"ph": "i", "name": "instant", "ts": 10},  # not a complete event
    ]
    s = summarize(events)
    assert s["steps"] == 2 and s["wall_ms"] == pytest.approx(2.0)
    assert s["compute_stream"] == "7"
    # stream 7 within 0-2000: 100-600, 1200-1500, 1600-2000
    assert s["busy_ms"] == pytest.approx(1.2)
    assert s["streams"]["20"] == pytest.approx(1.5)
    assert [(round(g["at_ms"], 6), round(g["ms"], 6)) for g in s["gaps"]] == [(0.6, 0.6), (0.0, 0.1), (1.5, 0.1)]
    assert s["gaps"][0]["op"] == "cudaStreamSynchronize"
    assert s["syncs"]["cudaStreamSynchronize"] == {"count": 1, "ms": pytest.approx(0.57)}
    assert s["syncs"]["cudaEventSynchronize"]["count"] == 1
    assert s["syncs"]["cudaDeviceSynchronize"]["count"] == 0
    text = "\n".join(format_summary(s))
    assert "60% of the wall time" in text and "cudaStreamSynchronize" in text


def test_summary_without_kernels_or_steps():
    s = summarize([_event("user_annotation", STEP_MARK, 0, 100), _event("cpu_op", "aten::mm", 10, 20)])
    assert s["compute_stream"] is None and s["gaps"] == []
    assert "no GPU kernels" in "\n".join(format_summary(s))
    with pytest.raises(ValueError):
        summarize([_event("cpu_op", "aten::mm", 10, 20)])


def test_phase_table_sets_host_against_gpu():
    lines = phase_table({"phase.fwd": 0.010, "gpu.fwd": 0.030, "phase.bwd": 0.02, "phase.opt": 0.001,
                         "phase.zero_grad": 0.0, "phase.wait": 0.05, "gpu.step": 0.1})
    fwd = next(line for line in lines if line.split()[0] == "fwd")
    assert fwd.split()[1:] == ["10.00", "30.00"]
    bwd = next(line for line in lines if line.split()[0] == "bwd")
    assert bwd.split()[1:] == ["20.00", "-"]
    step = next(line for line in lines if line.split()[0] == "step")
    assert step.split()[1:3] == ["31.00", "100.00"]


def test_gpt_bench_breakdown_and_profile_on_the_cpu(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(BENCH, "gpu_gpt_bench.py"), "--device", "cpu", "--configs", "zero1,zero3",
         "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch", "2", "--steps", "2",
         "--warmup", "1", "--breakdown", "--profile", str(tmp_path), "--zero-config", '{"prefetch_bytes": 0}'],
        capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("host ms") == 2 and out.stdout.count("profile: 2 steps") == 2
    assert "rounds" in out.stdout and "not timed" not in out.stdout  # zero3's hooks timed
    assert sorted(os.listdir(tmp_path)) == ["zero1-2L.json.gz", "zero3-2L.json.gz"]
