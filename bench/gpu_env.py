"""The GPU machine's environment, the head of bench/gpu_run.sh's results:
what the figures after it depend on.

    python bench/gpu_env.py                # each item, or why it could not be read
    python bench/gpu_env.py --require-gpu  # and exit 1 when torch sees no CUDA device

The GPU (nvidia-smi: name, memory, driver), torch and the CUDA it was built
with, NCCL's version (torch.cuda.nccl.version()), whether FSDP2 skips its
collectives at world size 1 (the places in its param group that test
`world_size == 1`: the single-GPU bench's FSDP2 then pays no all-gather
where zerocore may), whether the MPS control daemon is installed, and
ZEROCORE_CUDA_POISON (its NaN fills cost every release a memset: benchmarks
must run without it).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess

FSDP2_PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"


def item(label: str, read) -> None:
    try:
        value = read()
    except Exception as e:  # an environment report: a missing piece is itself the finding
        value = f"unknown ({type(e).__name__}: {e})"
    print(f"{label + ':':<24} {value}", flush=True)


def nvidia_smi() -> str:
    if not shutil.which("nvidia-smi"):
        return "no nvidia-smi on PATH"
    return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30, check=True).stdout.strip()


def fsdp2_world_size_1() -> str:
    path = importlib.util.find_spec(FSDP2_PARAM_GROUP).origin
    with open(path) as f:
        n = f.read().count("world_size == 1")
    return f"{n} place(s) test world_size == 1 ({'skips collectives' if n else 'no shortcut'}) in {path}"


def main(argv=None) -> int:
    # Not _harness.parser: _harness imports torch, which this report must not need to start.
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--require-gpu", action="store_true", help="exit 1 when torch sees no CUDA device")
    args = p.parse_args(argv)
    import torch

    item("GPU", nvidia_smi)
    item("torch", lambda: f"{torch.__version__}, CUDA {torch.version.cuda}, "
                          f"device visible: {torch.cuda.is_available()}")
    item("NCCL", lambda: ".".join(map(str, torch.cuda.nccl.version())))
    item("FSDP2 at world size 1", fsdp2_world_size_1)
    item("MPS control", lambda: shutil.which("nvidia-cuda-mps-control") or "not installed")
    item("ZEROCORE_CUDA_POISON", lambda: os.environ.get("ZEROCORE_CUDA_POISON", "unset"))
    if args.require_gpu and not torch.cuda.is_available():
        print("gpu_env: no CUDA device visible to torch")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
