#!/usr/bin/env bash
# Every zerocore test from a fresh clone, set-up included. It makes a new
# virtual environment in a temporary directory and installs into it only
# what the project's own files declare (pyproject.toml: the package, its
# `test` extra, torch pinned to the CPU build), so a dependency the project
# forgot to declare fails here instead of hiding behind the machine's own
# packages. Then it runs the C++ tests (ctest), the GPU run's dry run
# where a CUDA compiler is (bench/gpu_run.sh --dry-run) and the Python tests
# (pytest); GPU tests skip without a GPU. First of all it checks that every
# mutation of tests/mutations.py still applies (--check). Extra arguments go to pytest.
# Last, the checked subset runs again under the checking backend
# (ZEROCORE_BACKEND=checking, tests/README.md).
#
#   PYTHON=python3.12 bash tests/run.sh       # another interpreter
#   bash tests/run.sh -k engine -x            # a subset of the Python tests
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# Each phase's wall time, to keep the whole run (CI's) under 20 minutes.
phase_start=$SECONDS
phase_done() {
  echo "tests/run.sh: $1 took $((SECONDS - phase_start)) s (total $SECONDS s)"
  phase_start=$SECONDS
}

# The mutations' anchors still apply (the script itself runs on demand: it
# rebuilds and tests per mutation); seconds, plain Python, before any set-up.
"$PYTHON" tests/mutations.py --check
phase_done "the mutations' anchors"

scratch=$(mktemp -d "${TMPDIR:-/tmp}/zerocore-tests.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
"$PYTHON" -m venv "$scratch/venv"
venv="$scratch/venv/bin"

# Where a CUDA compiler is, the CUDA builds (the package's, the C++ one and
# the GPU script's dry run) compile the native NCCL transport too: it needs
# nccl.h, from the nvidia-nccl-cu13 wheel (about 300 MB), installed into the
# venv and named to both builds (the package's build is isolated from the venv).
cuda=0 nccl_cmake=() nccl_pip=()
if command -v nvcc > /dev/null || [[ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" || -x /usr/local/cuda/bin/nvcc ]]; then
  cuda=1
  "$venv/python" -m pip install -q nvidia-nccl-cu13
  nccl_include=$("$venv/python" -c 'import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], "include"))')
  nccl_cmake=(-DZEROCORE_NCCL_INCLUDE_DIR="$nccl_include")
  nccl_pip=(-Ccmake.define.ZEROCORE_NCCL_INCLUDE_DIR="$nccl_include")
fi

# The build runs isolated, from pyproject.toml's build-system requirements.
"$venv/python" -m pip install -q torch==2.13.0 "${nccl_pip[@]}" ".[test]"
phase_done "set-up (venv, torch, the package built)"

"$venv/cmake" -S . -B "$scratch/native" -G Ninja -DCMAKE_MAKE_PROGRAM="$venv/ninja" \
  -DCMAKE_BUILD_TYPE=Release -DZEROCORE_PYTHON=OFF "${nccl_cmake[@]}"
"$venv/cmake" --build "$scratch/native"
"$venv/ctest" --test-dir "$scratch/native" --output-on-failure --timeout 300
phase_done "the C++ build and tests"

# The GPU run up to the GPU itself (bench/gpu_run.sh --dry-run: the GPU
# environment's report, tests/gpu.sh --dry-run's imports and test
# collection, each GPU benchmark's arguments), wherever a CUDA compiler is.
# The package and the C++ build above found the same compiler
# (ZEROCORE_CUDA=AUTO), so the dry run uses them rather than compiling the
# CUDA kernels again.
if (( cuda )); then
  PATH="$venv:$PATH" PYTHON="$venv/python" ZEROCORE_REUSE_BUILD="$scratch/native" \
    bash bench/gpu_run.sh --dry-run "$scratch/gpu-dry-run.txt"
  phase_done "bench/gpu_run.sh --dry-run"
else
  echo "tests/run.sh: no CUDA compiler found; skipping bench/gpu_run.sh --dry-run"
fi

# From the repository root `python/zerocore` is not on the path, so the
# tests import the installed package. Two test processes (pytest-xdist):
# a test's ranks wait on each other and on gloo for about a third of its
# time, which the other process fills (on 2 cores: 22% less wall time, the
# same CPU time). `-n 0` among the extra arguments runs one.
workers=(-n 2)
"$venv/python" -m pytest -q -p no:cacheprovider "${workers[@]}" tests "$@"
phase_done "the Python tests"

# The checked subset under the checking backend: every comm queue's
# collectives, every wait for them and the schedules' slots are checked
# (a violation raises StreamOrderError on its rank), with the same
# references. Stages 0-3, offload, divergent units, partitioned activation
# checkpoints, coalesced units, the partition store, the host waits a step
# makes, a stream-order violation in a unit's hook raising on every rank,
# grads accumulated in place in the reduce staging, stage 3's
# reductions running behind backward, snapshots' reads of the master
# and optimizer states (declared on the compute stream) after the update,
# and deterministic mode's grads put on their grids in the reduce staging.
ZEROCORE_BACKEND=checking "$venv/python" -m pytest -q -p no:cacheprovider "${workers[@]}" \
  tests/test_engine_equivalence.py tests/test_offload.py tests/test_divergent_units.py tests/test_moe_example.py \
  tests/test_activation_checkpoint.py tests/test_coalesced_units.py tests/test_host_waits.py \
  tests/test_stream_order_failure.py tests/test_partition_store.py tests/test_grad_views.py \
  tests/test_reduction_overlap.py tests/test_snapshots.py::test_restored_in_process_equals_the_uninterrupted_run \
  tests/test_snapshots.py::test_a_lost_node_of_two_ranks_is_restored_from_the_next_node tests/test_deterministic.py
phase_done "the checked subset"
