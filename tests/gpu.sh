#!/usr/bin/env bash
# The GPU path, checked in one command on a machine with an NVIDIA GPU:
#
#   bash tests/gpu.sh [results file]          # default: gpu-results.txt
#
# Nothing is downloaded (GPU machines may reach no registry, and their torch
# may be older than the CPU pin): it builds zerocore with CUDA into a
# scratch folder with the python3 already there (its torch, nanobind,
# scikit-build-core, cmake, ninja and pytest), runs the C++ tests with the
# CUDA ones (ctest), every Python test marked gpu and the GPU benchmarks,
# and writes all they print to the results file. Without a visible GPU it
# fails at once instead of skipping everything quietly.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
results=$(realpath -m "${1:-gpu-results.txt}")
scratch=$(mktemp -d "${TMPDIR:-/tmp}/zerocore-gpu.XXXXXX")
trap 'rm -rf "$scratch"' EXIT

{
  echo "# zerocore GPU run, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device visible"; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
  cmake -S . -B "$scratch/native" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZEROCORE_PYTHON=OFF -DZEROCORE_CUDA=ON
  cmake --build "$scratch/native"
  ctest --test-dir "$scratch/native" --output-on-failure --timeout 300
  "$PYTHON" -m pip install -q --no-build-isolation --no-deps --no-index --target "$scratch/site" \
    -C cmake.define.ZEROCORE_CUDA=ON .
  export PYTHONPATH="$scratch/site"
  "$PYTHON" -c 'import zerocore.cuda as c; assert c.is_available(), "zerocore was built without usable CUDA kernels"'
  "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests
  "$PYTHON" bench/gpu_adam_bench.py
} 2>&1 | tee "$results"
