#!/usr/bin/env bash
# Every zerocore test from a fresh clone, set-up included: installs the CPU
# build of torch and the build tools, builds and installs the package (the
# CUDA module too when nvcc is found), then runs the C++ tests (ctest) and
# the Python tests (pytest). GPU tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

"$PYTHON" -m pip install -q torch==2.13.0 "scikit-build-core>=0.10" "nanobind>=2.4" "cmake>=3.21" ninja pytest
"$PYTHON" -m pip install -q --no-build-isolation .

cmake -S . -B build/native -G Ninja -DCMAKE_BUILD_TYPE=Release -DZEROCORE_PYTHON=OFF
cmake --build build/native
ctest --test-dir build/native --output-on-failure

# Run from tests/ so `import zerocore` finds the installed package.
"$PYTHON" -m pytest -q -p no:cacheprovider tests "$@"
