"""The native NCCL transport (zerocore/comm/nccl.py, cuda/src/nccl_transport.cpp).

Everywhere: Config(nccl=...)'s validation; where the library is looked for;
the loader's errors (a missing library names its path, a library without
NCCL's entry points names the missing one, both the fallback), run against
the real loader where the build has the transport; the choice refusing a
CPU model and a build without the transport; the unique id's exchange
through the store torch.distributed's ranks share, on 2 processes; the CMake
detection of nccl.h (cmake/nccl.cmake in script mode); when NCCL lets
several ranks share a GPU (gpu_data_planes.py: test_gpu_ranks' NCCL planes
run or skip by it).

Marked `gpu` (tests/gpu.sh; skipped here): at world size 1 on cuda:0, each
collective of a native queue against torch.distributed's on the same
inputs, and the engine trained with nccl="native" against nccl="torch".
"""
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist

import zerocore
import zerocore.cuda
import zerocore.comm.nccl as native_nccl
import gpu_data_planes
from dist_harness import run_ranks
from models import assert_state_close, engine_train, lm_batch, make
from test_gpu_engine import world1  # noqa: F401 - the fixture: a world of one rank on cuda:0

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
built = pytest.mark.skipif(not native_nccl.is_built(), reason="zerocore was built without the NCCL transport")


# Config ----------------------------------------------------------------------
def test_config_nccl_defaults_to_torch_and_takes_native():
    assert zerocore.Config().nccl == "torch"
    assert zerocore.Config.from_any({"nccl": "native"}).nccl == "native"


def test_config_nccl_refuses_anything_else():
    with pytest.raises(ValueError, match=r"nccl='nvidia'; use \"torch\" .* or \"native\""):
        zerocore.Config(nccl="nvidia")


# Choosing the transport ------------------------------------------------------
def test_native_on_a_cpu_model_raises_naming_the_fix():
    model = make()
    with pytest.raises(ValueError, match=r"trains on the CPU; use Config\(nccl=\"torch\"\)"):
        zerocore.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), zerocore.Config(stage=0, nccl="native"))


def test_loading_without_the_transport_says_why_and_the_fallback(monkeypatch):
    monkeypatch.setattr(native_nccl, "is_built", lambda: False)
    reason = native_nccl.unavailable_reason()
    assert "nccl.h" in reason or "without CUDA" in reason
    with pytest.raises(RuntimeError, match=r"not available: .*Use Config\(nccl=\"torch\"\)"):
        native_nccl.load()


def test_unavailable_reason_is_none_exactly_when_built():
    assert (native_nccl.unavailable_reason() is None) == native_nccl.is_built()


# Where the library is looked for -----------------------------------------------
def test_library_path_prefers_the_environment(monkeypatch):
    monkeypatch.setenv("ZEROCORE_NCCL_LIBRARY", "/opt/nccl/libnccl.so.2")
    assert native_nccl.library_path() == "/opt/nccl/libnccl.so.2"


def test_library_path_takes_the_pip_package_then_the_loader(monkeypatch, tmp_path):
    monkeypatch.delenv("ZEROCORE_NCCL_LIBRARY", raising=False)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libnccl.so.2").write_bytes(b"")
    package = types.ModuleType("nvidia.nccl")
    package.__path__ = [str(tmp_path)]
    monkeypatch.setitem(sys.modules, "nvidia", types.ModuleType("nvidia"))
    monkeypatch.setattr(sys.modules["nvidia"], "nccl", package, raising=False)
    monkeypatch.setitem(sys.modules, "nvidia.nccl", package)
    assert native_nccl.library_path() == str(tmp_path / "lib" / "libnccl.so.2")
    monkeypatch.setitem(sys.modules, "nvidia.nccl", None)  # not installed
    monkeypatch.delattr(sys.modules["nvidia"], "nccl")
    assert native_nccl.library_path() == ""


# The loader (native) -----------------------------------------------------------
@built
def test_a_missing_library_names_its_path_and_the_fallback(monkeypatch):
    monkeypatch.setenv("ZEROCORE_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
    with pytest.raises(RuntimeError, match=r"cannot load NCCL from /nonexistent/libnccl.so.2: .*"
                                           r"Config\(nccl=\"torch\"\)"):
        native_nccl.load()


@built
def test_a_library_without_nccls_symbols_names_the_missing_one():
    with pytest.raises(RuntimeError, match=r"libm.so.6 has no ncclGetVersion, .*ZEROCORE_NCCL_LIBRARY"):
        zerocore._native.NcclLibrary("libm.so.6")


@built
@pytest.mark.skipif(native_nccl.library_path() == "", reason="no nvidia-nccl package here")
def test_the_pip_packages_library_loads_with_its_version():
    library = native_nccl.load()
    assert library.path == native_nccl.library_path()
    assert library.version // 10000 == 2
    ids = library.unique_id(), library.unique_id()
    assert [len(i) for i in ids] == [128, 128] and ids[0] != ids[1]


# The bootstrap ---------------------------------------------------------------
ID_BYTES = bytes(range(256)) * 2  # every byte value, NUL and non-UTF-8 ones included


def _exchange(rank, world):
    group = dist.new_group(list(range(world)), use_local_synchronization=True)
    other = dist.new_group(list(range(world)), use_local_synchronization=True)
    store = dist.distributed_c10d._get_default_store()
    made = []

    def make_id():
        made.append(rank)
        return ID_BYTES

    got = native_nccl.exchange_unique_id(store, native_nccl.store_key(group), rank, make_id)
    return got, made, native_nccl.store_key(group), native_nccl.store_key(other)


def test_rank_0_makes_the_unique_id_and_every_rank_gets_its_bytes():
    results = run_ranks(_exchange, 2)
    assert [r[0] for r in results] == [ID_BYTES, ID_BYTES]
    assert [r[1] for r in results] == [[0], []]  # made once, by rank 0
    assert results[0][2] == results[1][2]  # the same key on every rank
    assert results[0][2] != results[0][3]  # and another for another group (engine)


# Several ranks on one GPU ------------------------------------------------------
@pytest.mark.parametrize("code,version", [(22809, (2, 28, 9)), (23003, (2, 30, 3)), (23203, (2, 32, 3)),
                                          (2708, (2, 7, 8))])
def test_nccl_version_codes_read_as_major_minor_patch(code, version):
    assert gpu_data_planes.version_of(code) == version


def test_several_ranks_on_one_gpu_need_nccl_2_30_and_the_refusal_names_the_version():
    refusal = gpu_data_planes.multi_rank_refusal((2, 28, 9), "torch's NCCL")
    assert refusal.startswith("torch's NCCL is NCCL 2.28.9;") and ">= 2.30.0" in refusal
    assert "NCCL_MULTI_RANK_GPU_ENABLE=1" in refusal
    assert gpu_data_planes.multi_rank_refusal((2, 29, 99), "x") is not None
    assert gpu_data_planes.multi_rank_refusal((2, 30, 0), "x") is None
    assert gpu_data_planes.multi_rank_refusal((3, 0, 0), "x") is None


def test_the_nccl_planes_enable_multi_rank_gpus_and_keep_gloo_for_control():
    planes = {p.name: p for p in gpu_data_planes.PLANES}
    assert planes["gloo"].group == "gloo" and planes["gloo"].env == {}
    for name, nccl in (("nccl", "torch"), ("nccl-native", "native")):
        assert planes[name].group == "cpu:gloo,cuda:nccl"
        assert zerocore.Config(**planes[name].config).nccl == nccl
        assert planes[name].env == {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}


# CMake's detection -------------------------------------------------------------
# The test extra's cmake (beside this interpreter: tests/run.sh's venv), else the PATH's.
_CMAKE = next((c for c in (os.path.join(os.path.dirname(sys.executable), "cmake"), shutil.which("cmake"))
               if c and os.path.exists(c)), None)


def _detect(*defines):
    run = subprocess.run([_CMAKE, *[f"-D{d}" for d in defines], "-P", os.path.join(ROOT, "cmake", "nccl.cmake")],
                         capture_output=True, text=True)
    return run.returncode, run.stdout + run.stderr


@pytest.fixture
def cmake():
    if _CMAKE is None:  # outside tests/run.sh only: the test extra installs cmake
        pytest.skip("no cmake beside this Python or on the PATH")


def test_cmake_builds_the_transport_where_it_finds_nccl_h(cmake, tmp_path):
    (tmp_path / "nccl.h").write_text("")
    rc, out = _detect(f"ZEROCORE_NCCL_INCLUDE_DIR={tmp_path}")
    assert rc == 0 and f"native NCCL transport ON (nccl.h in {tmp_path})" in out


def test_cmake_finds_nccl_h_in_the_pip_package_of_its_python(cmake, tmp_path):
    (tmp_path / "nvidia" / "nccl" / "include").mkdir(parents=True)
    (tmp_path / "nvidia" / "nccl" / "include" / "nccl.h").write_text("")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    rc, out = _detect(f"Python_EXECUTABLE={python}")
    assert rc == 0 and f"ON (nccl.h in {tmp_path}/nvidia/nccl/include)" in out


def test_cmake_leaves_the_transport_out_without_nccl_h(cmake, tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 1\n")  # a Python without the package
    python.chmod(0o755)
    rc, out = _detect(f"Python_EXECUTABLE={python}")
    assert rc == 0 and "native NCCL transport OFF (no nccl.h" in out
    rc, out = _detect(f"ZEROCORE_NCCL_INCLUDE_DIR={tmp_path}")
    assert rc != 0 and "holds no nccl.h" in out


# On a GPU ----------------------------------------------------------------------
def gpu(f):
    """Marks a test as needing a CUDA device and the transport, and skips it without them."""
    ready = torch.cuda.is_available() and zerocore.cuda.is_available() and native_nccl.is_built()
    skip = pytest.mark.skipif(not ready, reason="needs a CUDA device and zerocore built with CUDA and the NCCL "
                                                "transport")
    return pytest.mark.gpu(skip(f))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_collectives_match_torch_distributed(world1, dtype):
    backend = zerocore._native.CudaBackend(0, torch.cuda.current_stream().cuda_stream)
    group = dist.new_group([0])
    queue = native_nccl.queue(group, backend, None)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(4096, generator=g).to(world1, dtype)
    want = torch.empty_like(x)
    got = torch.full_like(x, float("nan"))
    dist.all_gather_into_tensor(want, x)
    queue.all_gather((0, 0, 0, x.numel()), x, got).wait()
    assert torch.equal(got, want)
    dist.reduce_scatter_tensor(want, x.clone())
    got.fill_(float("nan"))
    queue.reduce_scatter((1, 0, 0, x.numel()), x.clone(), got).wait()
    assert torch.equal(got, want)
    want, got = x.clone(), x.clone()
    dist.all_reduce(want)
    queue.all_reduce((2, 0, 0, x.numel()), got).wait()
    assert torch.equal(got, want)
    dist.broadcast(want, 0)
    queue.broadcast((3, -1, 3, x.numel()), got, 0).wait()
    assert torch.equal(got, want)
    queue.close()


def _train(device, config):
    model = make().to(device)
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    losses = []
    state = engine_train(engine, 0, 1, 3, 2, batch=lambda s, m, w: tuple(t.to(device) for t in lm_batch(s, m, w)),
                         losses=losses)
    engine.close()
    return losses, {k: v.cpu() for k, v in state.items()}


@gpu
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_engine_on_native_nccl_trains_as_on_torchs(world1, stage):
    config = dict(stage=stage, bucket_bytes=256)
    native_losses, native_state = _train(world1, zerocore.Config(nccl="native", **config))
    torch_losses, torch_state = _train(world1, zerocore.Config(nccl="torch", **config))
    assert native_losses == torch_losses
    assert_state_close(native_state, torch_state, rtol=0, atol=0, what=f"stage {stage}")
