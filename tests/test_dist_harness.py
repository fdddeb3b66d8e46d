"""The test harness itself (dist_harness.py, conftest.py): a rank that dies is
reported at once as a crash with its exit status and output, a hang is still
a hang, and a failing test names the seed that replays it."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from dist_harness import RankCrash, RankError, run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


def _dies(rank, world, how):
    dist.barrier()
    if rank == 1:
        print("rank 1 says goodbye", flush=True)
        if how == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        os._exit(3 if how == "exit 3" else 0)
    dist.barrier()  # rank 0 waits for its peer here, as a rank would in a collective


@pytest.mark.parametrize("how, status", [("segfault", "killed by SIGSEGV"), ("exit 3", "exited with code 3"),
                                         ("exit 0", "exited with code 0")])
def test_a_dead_rank_is_reported_at_once_as_a_crash(how, status):
    start = time.monotonic()
    with pytest.raises(RankCrash) as crash:
        run_ranks(_dies, 2, how, timeout=60)
    assert time.monotonic() - start < 20, "reported at the deadline, not when the rank died"
    assert crash.value.rank == 1 and f"rank 1 crashed: {status}" in str(crash.value)
    assert "rank 1 says goodbye" in crash.value.output
    if how == "segfault":  # native crashes leave a stack in the rank's output
        assert "Fatal Python error: Segmentation fault" in crash.value.output


def _sums(rank, world):
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    return os.getpid(), t


def test_spawned_ranks_run_in_fresh_interpreters():
    """What the GPU tests start ranks with (CUDA fails in a forked child)."""
    results = run_ranks(_sums, 3, timeout=120, start="spawn")
    assert len({pid for pid, _ in results} | {os.getpid()}) == 4
    for _, t in results:
        assert torch.equal(t, torch.full((3,), 6.0))
    with pytest.raises(RankCrash, match="rank 1 crashed: exited with code 3"):
        run_ranks(_dies, 2, "exit 3", timeout=120, start="spawn")


def _group_backend(rank, world):
    return dist.get_backend_config(), _sums(rank, world)[1]


def test_ranks_start_on_the_process_group_backend_asked_for():
    """What the GPU tests' NCCL planes give ("cpu:gloo,cuda:nccl"); here its CPU half alone."""
    for config, summed in run_ranks(_group_backend, 2, group="cpu:gloo"):
        assert config == "cpu:gloo" and torch.equal(summed, torch.full((3,), 3.0))


def _hangs(rank, world):
    if rank == 1:
        print("rank 1 sleeps", flush=True)
        time.sleep(600)
    dist.barrier()


def test_a_hang_is_still_a_hang_with_the_ranks_stacks():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0, 1\] did not finish within 3s \(hang\)") as hang:
        run_ranks(_hangs, 2, timeout=3)
    assert time.monotonic() - start < 15
    message = str(hang.value)
    assert "rank 1 sleeps" in message
    assert re.search(r"File .*test_dist_harness.py.*line \d+ in _hangs", message), message  # the stack it hung in


def _raises_or_returns(rank, world):
    print(f"rank {rank} printed this")
    if rank == 1:
        raise ValueError("rank 1's own error")
    return {"rank": rank, "t": torch.arange(3)}


def test_results_errors_and_output_come_back(capsys):
    ok, err = run_ranks(_raises_or_returns, 2, raise_errors=False)
    assert ok["rank"] == 0 and torch.equal(ok["t"], torch.arange(3))
    assert isinstance(err, RankError) and err.exc_type == "ValueError" and err.message == "rank 1's own error"
    out = capsys.readouterr().out
    assert "--- rank 0 output ---\nrank 0 printed this" in out and "rank 1 printed this" in out


def _pytest(directory, seed=None):
    env = {k: v for k, v in os.environ.items() if k != "ZEROCORE_TEST_SEED"}
    if seed is not None:
        env["ZEROCORE_TEST_SEED"] = seed
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(directory)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 1, run.stdout + run.stderr  # the test failed, as written
    return run.stdout


def test_a_failing_test_names_its_seed_and_the_seed_replays_it(tmp_path):
    shutil.copy(os.path.join(HERE, "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_draws.py").write_text(
        "import torch\n"
        "def test_draws(gen):\n"
        "    print('draws', torch.randn(3, generator=gen).tolist(), torch.rand(2).tolist())\n"
        "    assert False\n")
    first = _pytest(tmp_path)
    seed = re.search(r"zerocore test seed -+\nZEROCORE_TEST_SEED=(\d+) replays", first)
    assert seed, first
    draws = re.findall(r"^draws .*$", first, re.M)
    assert len(draws) == 1, first
    assert re.findall(r"^draws .*$", _pytest(tmp_path, seed.group(1)), re.M) == draws  # gen's and torch's own
