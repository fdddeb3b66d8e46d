#!/usr/bin/env bash
# The GPU path, checked in one command on a machine with an NVIDIA GPU:
#
#   bash tests/gpu.sh [results file]            # default: gpu-results.txt
#   bash tests/gpu.sh --dry-run [results file]  # anywhere nvcc is: CI runs this
#
# Nothing is downloaded (GPU machines may reach no registry, and their torch
# may be older than the CPU pin): it builds zerocore with CUDA into a
# scratch folder with the python3 already there (its torch, nanobind,
# scikit-build-core, cmake, ninja and pytest), runs the C++ tests with the
# CUDA ones (ctest), every Python test marked gpu (with
# ZEROCORE_CUDA_POISON=1: the engine's CUDA backend fills what it releases
# with NaN, so a stale read shows) and the GPU benchmarks (without it), and
# writes all they print to the results file. Without a visible GPU it
# fails at once instead of skipping everything quietly.
#
# ZEROCORE_REUSE_BUILD names a CMake build folder of this tree, built with
# CUDA, to run the C++ tests from, and says that the zerocore installed for
# $PYTHON was built with CUDA too: neither is built again (tests/run.sh
# passes its own, so CI compiles the CUDA kernels once per build kind).
#
# --dry-run needs no GPU and no driver: it makes the same two CUDA builds,
# lists the C++ tests, imports zerocore.cuda from the CUDA build, checks
# that the native NCCL transport was built (nccl.h found: tests/run.sh
# installs nvidia-nccl-cu13 for it), collects
# every GPU test (at least one, none failing to import) and starts each GPU
# benchmark far enough to parse its arguments, and writes the results file:
# everything the real run needs up to the GPU itself.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then
  dry_run=1
  shift
fi
results=$(realpath -m "${1:-gpu-results.txt}")
scratch=$(mktemp -d "${TMPDIR:-/tmp}/zerocore-gpu.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
native=${ZEROCORE_REUSE_BUILD:-$scratch/native}

{
  echo "# zerocore GPU run, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  if (( dry_run )); then
    echo "# dry run: builds, imports and collection only; nothing ran on a GPU"
  else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device visible"; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
  fi
  cmake -S . -B "$native" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZEROCORE_PYTHON=OFF -DZEROCORE_CUDA=ON
  cmake --build "$native"
  if (( dry_run )); then
    ctest --test-dir "$native" -N
  else
    ctest --test-dir "$native" --output-on-failure --timeout 300
  fi
  if [[ -z "${ZEROCORE_REUSE_BUILD:-}" ]]; then
    "$PYTHON" -m pip install -q --no-build-isolation --no-deps --no-index --target "$scratch/site" \
      -C cmake.define.ZEROCORE_CUDA=ON .
    export PYTHONPATH="$scratch/site"
  fi
  if (( dry_run )); then
    "$PYTHON" -c 'import zerocore.cuda as c; assert c.is_built(), "zerocore was built without the CUDA kernels"'
    "$PYTHON" -c 'import zerocore.nccl as n; assert n.is_built(), n.unavailable_reason()'
    collected=$("$PYTHON" -m pytest -q -p no:cacheprovider -m gpu --collect-only tests | tail -n 1)
    echo "$collected"
    [[ "$collected" =~ ^([0-9]+)/[0-9]+\ tests\ collected ]] && (( BASH_REMATCH[1] > 0 )) ||
      { echo "gpu.sh --dry-run: no GPU test collected" >&2; exit 1; }
    "$PYTHON" bench/gpu_adam_bench.py --help > /dev/null
    "$PYTHON" bench/gpu_gpt_bench.py --dry-run
    "$PYTHON" bench/gpu_gpt_bench.py --mode offload --dry-run
  else
    "$PYTHON" -c 'import zerocore.cuda as c; assert c.is_available(), "zerocore was built without usable CUDA kernels"'
    # Poisoned: a read of a released slot or staging range shows as NaN.
    ZEROCORE_CUDA_POISON=1 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests
    "$PYTHON" bench/gpu_adam_bench.py
    "$PYTHON" bench/gpu_gpt_bench.py
    "$PYTHON" bench/gpu_gpt_bench.py --mode offload --budget 90
  fi
} 2>&1 | tee "$results"
