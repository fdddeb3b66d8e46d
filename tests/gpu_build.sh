#!/usr/bin/env bash
# zerocore built with its CUDA kernels, once, for tests/gpu.sh and
# bench/gpu_run.sh, with the python3 already there (its torch, nanobind,
# scikit-build-core, cmake, ninja), downloading nothing:
#
#   bash tests/gpu_build.sh DIR
#
# DIR/site: the package (PYTHONPATH=DIR/site); DIR/native: its CMake build
# folder, with the C++ tests and the CUDA ones (ctest --test-dir DIR/native).
# One pip build with the C++ tests on, its build folder kept, so the CUDA
# kernels compile once for both (a minute each on a 16-core GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
dir=$(realpath -m "${1:?usage: tests/gpu_build.sh DIR}")
"$PYTHON" -m pip install -q --no-build-isolation --no-deps --no-index --target "$dir/site" \
  -C build-dir="$dir/native" -C cmake.define.ZEROCORE_CUDA=ON -C cmake.define.ZEROCORE_BUILD_TESTS=ON .
