"""Ctrl-C under torchrun: a real SIGINT reaching both ranks of a stage-3
job (tests/interrupted_job.py) as they are in a forward, in a backward or in
the step comes out of that engine call as KeyboardInterrupt, never an
internal error in its place; the user's handler zero_grad()s and saves on
every rank, and training goes on with the ranks at one step. In a forward
or backward the step is given up; in the step the signal is held until the
native step ends (interrupts.deferred): the step is applied, then the
KeyboardInterrupt comes. The checkpoint the handler wrote holds the params
the ranks hold after it."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import zerocore
from models import assert_state_close, make

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "interrupted_job.py")
WORLD = 2
# Where it comes out: the engine's calls in the KeyboardInterrupt's traceback; the steps applied after the handler.
EXPECTED = {"forward": ("forward", 1), "backward": ("backward", 1), "step": ("step", 2)}


def _interrupt(folder, where):
    """torchrun's exit code and output; SIGINT to each rank once every rank waits."""
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={WORLD}", "--monitor-interval=0.2", JOB, where, str(folder)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        waiting = [folder / f"waiting-{r}" for r in range(WORLD)]
        while not all(w.exists() for w in waiting) and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if all(w.exists() for w in waiting):
            for w in waiting:
                os.kill(int(w.read_text()), signal.SIGINT)
            time.sleep(0.2)  # delivered (held, in the step) before the wait ends
            (folder / "go").touch()
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    return job.returncode, output


@pytest.mark.parametrize("where", sorted(EXPECTED))
def test_sigint_under_torchrun_comes_out_as_itself_and_the_handler_saves(where, tmp_path):
    code, output = _interrupt(tmp_path, where)
    assert code == 0, output[-6000:]
    reports = [torch.load(tmp_path / f"rank-{r}.pt") for r in range(WORLD)]
    call, steps = EXPECTED[where]
    for rank, r in enumerate(reports):
        assert r["caught"] == "KeyboardInterrupt", (rank, r["caught"], output[-6000:])
        assert call in r["engine_calls"], (rank, r["engine_calls"])
        assert r["step_count_after"] == steps and r["step_count_end"] == steps + 1, (rank, r)
        assert_state_close(r["after"], reports[0]["after"], rtol=0, atol=0, what=f"rank {rank} after the handler")
        assert_state_close(r["end"], reports[0]["end"], rtol=0, atol=0, what=f"rank {rank} at the end")
    assert not torch.equal(reports[0]["end"]["blocks.0.up.weight"], reports[0]["after"]["blocks.0.up.weight"])
    model = make()  # the checkpoint, read back at one rank
    engine = zerocore.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), zerocore.Config(stage=0))
    engine.load(str(tmp_path / "checkpoint"))
    assert_state_close(engine.full_state_dict(), reports[0]["after"], rtol=0, atol=0, what="the checkpoint")
