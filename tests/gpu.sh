#!/usr/bin/env bash
# The GPU tests, in one command on a machine with an NVIDIA GPU (on a lent
# machine run bench/gpu_run.sh instead: it runs this, then the GPU
# benchmarks, within 9 minutes):
#
#   bash tests/gpu.sh [results file]            # default: gpu-results.txt
#   bash tests/gpu.sh --dry-run [results file]  # anywhere nvcc is (bench/gpu_run.sh --dry-run, so CI, runs it)
#
# Nothing is downloaded (GPU machines may reach no registry, and their torch
# may be older than the CPU pin): it builds zerocore with CUDA into a
# scratch folder (tests/gpu_build.sh, with the python3 already there), runs
# the C++ tests with the CUDA ones (ctest) and every Python test marked gpu
# (with ZEROCORE_CUDA_POISON=1: the engine's CUDA backend fills what it
# releases with NaN, so a stale read shows), and writes all they print to
# the results file. Each step runs under a time limit (tests/phases.sh); a
# step that fails is recorded, the next still runs, and the exit status is 1
# when any failed. Without a visible GPU it fails at once instead of
# skipping everything quietly.
#
# GPU_TESTS picks a part: "single" (the C++ tests, with the in-process
# several-ranks one, test_cuda_ranks, and every pytest GPU test but
# test_gpu_ranks.py), "ranks" (tests/test_gpu_ranks.py: several spawned
# ranks on cuda:0, each test's outcome printed as it ends, since the phase
# may be cut) or "all" (the default: both). bench/gpu_run.sh runs the two
# parts as phases of their own, each under its own limit.
#
# ZEROCORE_REUSE_BUILD names a CMake build folder of this tree, built with
# CUDA and the C++ tests, to run the C++ tests from, and says that the
# zerocore $PYTHON imports (PYTHONPATH included) was built with CUDA too:
# nothing is built (bench/gpu_run.sh passes its build; tests/run.sh its
# own, so CI compiles the CUDA kernels once per build kind).
#
# --dry-run needs no GPU and no driver: it makes the CUDA build, lists the
# C++ tests, imports zerocore.cuda from the build, checks that the native
# NCCL transport was built (nccl.h found: tests/run.sh installs
# nvidia-nccl-cu13 for it) and collects every GPU test (pytest fails when
# none is collected or one fails to import):
# everything the real run needs up to the GPU itself.
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/phases.sh
PYTHON=${PYTHON:-python3}
export PYTHON
dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then
  dry_run=1
  shift
fi
results=$(realpath -m "${1:-gpu-results.txt}")
scratch=$(mktemp -d "${TMPDIR:-/tmp}/zerocore-gpu.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
native=${ZEROCORE_REUSE_BUILD:-$scratch/native}
part=${GPU_TESTS:-all}
case "$part" in
  all|single|ranks) ;;
  *) echo "tests/gpu.sh: GPU_TESTS=$part; use all, single or ranks" >&2; exit 2 ;;
esac
single=0 ranks=0
[[ "$part" == ranks ]] || single=1
[[ "$part" == single ]] || ranks=1
ranks_tests=tests/test_gpu_ranks.py

{
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  echo "# zerocore GPU tests, $(date -u +%Y-%m-%dT%H:%MZ), commit $commit"
  if (( dry_run )); then
    echo "# dry run: build, imports and collection only; nothing ran on a GPU"
  else
    "$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device visible"'
  fi
  if [[ -z "${ZEROCORE_REUSE_BUILD:-}" ]]; then
    phase "build (CUDA)" 1200 bash tests/gpu_build.sh "$scratch"
    export PYTHONPATH="$scratch/site"
  fi
  if (( dry_run )); then
    (( ! single )) || phase "C++ tests (listed)" 60 ctest --test-dir "$native" -N
    phase "import zerocore.cuda" 120 "$PYTHON" -c \
      'import zerocore.cuda as c; assert c.is_built(), "zerocore was built without the CUDA kernels"'
    if (( single )); then
      phase "GPU tests (collected)" 300 "$PYTHON" -m pytest -qq -p no:cacheprovider -m gpu --collect-only \
        --ignore "$ranks_tests" tests
      phase "the native NCCL transport built" 120 "$PYTHON" -c \
        'import zerocore.comm.nccl as n; assert n.is_built(), n.unavailable_reason()'
    fi
    if (( ranks )); then
      phase "several ranks on one GPU (collected)" 300 "$PYTHON" -m pytest -qq -p no:cacheprovider -m gpu \
        --collect-only "$ranks_tests"
    fi
  else
    (( ! single )) || phase "C++ tests" 600 ctest --test-dir "$native" --output-on-failure --timeout 300
    phase "import zerocore.cuda" 120 "$PYTHON" -c \
      'import zerocore.cuda as c; assert c.is_available(), "zerocore was built without usable CUDA kernels"'
    if (( single )); then
      # Poisoned: a read of a released slot or staging range shows as NaN.
      phase "GPU tests (poisoned)" 900 env ZEROCORE_CUDA_POISON=1 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu \
        --ignore "$ranks_tests" tests
    fi
    if (( ranks )); then
      # -v: each test's outcome as it ends; -rs: why the NCCL planes skipped (the version).
      phase "several ranks on one GPU (poisoned)" 900 env ZEROCORE_CUDA_POISON=1 "$PYTHON" -m pytest -v -rs \
        -p no:cacheprovider -m gpu --durations=0 "$ranks_tests"
    fi
  fi
  phases_end
} 2>&1 | tee "$results"
