#!/usr/bin/env bash
# The first command to run on a lent GPU machine: every GPU figure in one
# call of at most 9 minutes (machines are lent for 15 minutes of device
# time, their 1-2 minute start included), written to one results file.
#
#   bash bench/gpu_run.sh [results file]            # default: gpu-run-results.txt
#   bash bench/gpu_run.sh --dry-run [results file]  # anywhere nvcc is, no GPU or driver: CI runs it
#
# In order, each a phase under its own time limit (tests/phases.sh), which
# prints its wall time; a phase that fails or times out is recorded and the
# run goes on to the next; the exit status is 1 when any failed:
#
#   environment   bench/gpu_env.py: GPU, driver, torch, CUDA, NCCL, FSDP2's
#                 world-size-1 shortcut, MPS, ZEROCORE_CUDA_POISON (then
#                 unset: the benchmarks run without it); no GPU ends the run
#   build         tests/gpu_build.sh: zerocore with CUDA, once, for all below
#   tests         tests/gpu.sh on that build (GPU_TESTS=single): the C++
#                 CUDA tests (the in-process ranks of test_cuda_ranks among
#                 them) and every pytest test marked gpu but
#                 test_gpu_ranks.py, poisoned
#   ranks         tests/gpu.sh GPU_TESTS=ranks: tests/test_gpu_ranks.py,
#                 several spawned ranks on cuda:0 over gloo and, where the
#                 NCCL is 2.30 or later, over NCCL, poisoned (a phase of its
#                 own, so that its spawns cannot eat the tests' limit)
#   adam          bench/gpu_adam_bench.py
#   throughput    bench/gpu_gpt_bench.py: torch, fsdp2, zero1-3 on a 1.31B
#                 GPT, each with its per-phase host and GPU times
#                 (--breakdown) and a profile summary (--profile; the gzip
#                 traces, when small, go to <results without .txt>-traces/)
#   offload       bench/gpu_gpt_bench.py --mode offload: the largest GPT
#                 zero3 and FSDP2 train with optimizer and params offloaded,
#                 searched for as long as the 9 minutes leave
#
# The limits add up to more than 9 minutes; each is cut to what is left of
# GPU_RUN_SECONDS (default 520: 9 minutes less the 10 s a killed phase may
# take to die and a margin), so the run ends in time even when something
# hangs, and the offload search gets the rest (docs/status.md has the
# phases' times on a GPU). The ranks phase's 150 s (about 11 spawns of 2-4
# CUDA ranks over gloo; the NCCL planes skip at once below NCCL 2.30) comes
# out of the offload search, which keeps at least 10 s; PHASES_DEADLINE
# still ends the run at 520 s whatever overruns.
#
# --dry-run runs everything up to the GPU: the build, tests/gpu.sh
# --dry-run and each benchmark's --dry-run with the real run's flags, with
# no deadline (a build on a small machine takes minutes). ZEROCORE_REUSE_BUILD
# (see tests/gpu.sh) skips the build, as tests/run.sh does with its own.
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/phases.sh
PYTHON=${PYTHON:-python3}
dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then
  dry_run=1
  shift
fi
results=$(realpath -m "${1:-gpu-run-results.txt}")
traces="${results%.txt}-traces"
scratch=$(mktemp -d "${TMPDIR:-/tmp}/zerocore-gpu-run.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
native=${ZEROCORE_REUSE_BUILD:-$scratch/native}

# Phase limits, seconds. A dry run builds on whatever machine CI has, and
# starts each benchmark only far enough to parse its arguments.
if (( dry_run )); then
  dry=(--dry-run) require_gpu=() build_s=1800 tests_s=600 ranks_s=600 bench_s=300 offload_search_s=60
else
  dry=() require_gpu=(--require-gpu) build_s=240 tests_s=140 ranks_s=150 bench_s=240
  PHASES_DEADLINE=$((SECONDS + ${GPU_RUN_SECONDS:-520}))
fi

{
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  echo "# zerocore GPU run, $(date -u +%Y-%m-%dT%H:%MZ), commit $commit"
  if (( dry_run )); then
    echo "# dry run: build, imports, collection and arguments only; nothing ran on a GPU"
  fi
  phase environment 60 "$PYTHON" bench/gpu_env.py "${require_gpu[@]}"
  if (( ${#phases_failed[@]} )); then
    echo "gpu_run: no GPU visible (or no torch); nothing else runs"
    phases_end || exit 1
  fi
  unset ZEROCORE_CUDA_POISON

  if [[ -z "${ZEROCORE_REUSE_BUILD:-}" ]]; then
    phase "build (CUDA)" "$build_s" env PYTHON="$PYTHON" bash tests/gpu_build.sh "$scratch"
    export PYTHONPATH="$scratch/site"
  fi
  phase "tests (tests/gpu.sh)" "$tests_s" env PHASES_NESTED=1 PYTHON="$PYTHON" ZEROCORE_REUSE_BUILD="$native" \
    GPU_TESTS=single bash tests/gpu.sh "${dry[@]}" "$scratch/gpu-results.txt"
  phase "ranks (tests/gpu.sh: several ranks on one GPU)" "$ranks_s" env PHASES_NESTED=1 PYTHON="$PYTHON" \
    ZEROCORE_REUSE_BUILD="$native" GPU_TESTS=ranks bash tests/gpu.sh "${dry[@]}" "$scratch/gpu-ranks-results.txt"
  phase "adam (bench/gpu_adam_bench.py)" 60 "$PYTHON" bench/gpu_adam_bench.py "${dry[@]}"
  # zero3 and its peers first (the breakdown is for zero3's gap to FSDP2
  # and torch, bench/RESULTS.md), stages 1-2 last, should the limit cut
  # the phase short.
  phase "throughput (bench/gpu_gpt_bench.py)" "$bench_s" "$PYTHON" bench/gpu_gpt_bench.py \
    --configs zero3,fsdp2,torch,zero1,zero2 --breakdown --profile "$traces" --timeout 60 "${dry[@]}"
  # The offload search's budget is per config (zero3, then FSDP2); each may
  # overrun it by the run it started last: 45 s each are kept for that (a
  # guess, not measured; the phase's limit still holds).
  if (( ! dry_run )); then
    offload_search_s=$(( (PHASES_DEADLINE - SECONDS - 90) / 2 ))
    (( offload_search_s >= 10 )) || offload_search_s=10
  fi
  phase "offload (bench/gpu_gpt_bench.py --mode offload)" 600 "$PYTHON" bench/gpu_gpt_bench.py --mode offload \
    --steps 3 --warmup 1 --breakdown --timeout 60 --budget "$offload_search_s" "${dry[@]}"
  echo "gpu_run: $SECONDS s in all"
  phases_end
} 2>&1 | tee "$results"
