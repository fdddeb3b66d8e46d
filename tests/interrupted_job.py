"""The training job of test_ctrl_c_torchrun.py: 2 gloo ranks at stage 3,
run by torchrun, interrupted by a real SIGINT at step 1 of 3.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/interrupted_job.py WHERE DIR

At step 1 each rank waits at WHERE, after writing its pid to
DIR/waiting-RANK: "forward" (a forward pre-hook of a block, its unit
gathered), "backward" (a hook on a block's output grad, inside
engine.backward) or "step" (as engine.step's native call is entered, after
the ranks met at the step: a SIGINT there is held until the call ends,
interrupts.deferred). The test sends each rank SIGINT, as a terminal's
Ctrl-C reaches every process of the job, then writes DIR/go, which ends the
wait in the step (in a forward or backward the KeyboardInterrupt ends it).
The loop's handler is a user's: zero_grad() and save() on every rank; step
2 trains. Each rank writes DIR/rank-RANK.pt: what it caught and which of
the engine's calls it came out of, step_count after the handler, the full
params after the handler and at the end.
"""
import datetime
import faulthandler
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

import zerocore
from models import lm_batch, lm_loss, local, make

STEPS, INTERRUPTED = 3, 1
WAIT_AT_MOST = 60  # seconds a rank waits for the SIGINT (or the go) before it gives up


def wait_for_the_signal(folder, rank):
    """Tells the test this rank waits, then waits for the SIGINT (raised
    here, unless held) or the test's go."""
    with open(os.path.join(folder, f"waiting-{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(folder, f"waiting-{rank}.tmp"), os.path.join(folder, f"waiting-{rank}"))
    deadline = time.monotonic() + WAIT_AT_MOST
    while not os.path.exists(os.path.join(folder, "go")):
        if time.monotonic() > deadline:
            raise RuntimeError("interrupted_job: no SIGINT nor go came")
        time.sleep(0.01)


class WaitingStep:
    """The engine's native step, waiting as it is entered at step
    INTERRUPTED (its other attributes the step's own)."""

    def __init__(self, native, engine, folder, rank):
        self._native, self._engine, self._folder, self._rank = native, engine, folder, rank

    def __getattr__(self, name):
        return getattr(self._native, name)

    def step(self, *args, **kwargs):
        if self._engine.step_count == INTERRUPTED:
            wait_for_the_signal(self._folder, self._rank)
        return self._native.step(*args, **kwargs)


def main():
    where, folder = sys.argv[1], sys.argv[2]
    faulthandler.dump_traceback_later(120, exit=True)  # a hang shows where, in the job's output
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make()
    engine = zerocore.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), zerocore.Config(stage=3))
    step = 0

    def wait_here(*_):
        if step == INTERRUPTED:
            wait_for_the_signal(folder, rank)

    def wait_in_backward(module, args, out):
        out.register_hook(wait_here)

    if where == "forward":
        model.blocks[1].register_forward_pre_hook(wait_here)
    elif where == "backward":
        model.blocks[1].register_forward_hook(wait_in_backward)
    else:
        engine.zero_step = WaitingStep(engine.zero_step, engine, folder, rank)
    report = {"caught": None}
    for step in range(STEPS):
        x, y = lm_batch(step, 0, world)
        try:
            engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
            engine.step()
            engine.zero_grad()
        except BaseException as e:  # noqa: BLE001 - a user's handler: save, then go on
            report["caught"] = type(e).__name__
            report["engine_calls"] = [f.name for f in traceback.extract_tb(e.__traceback__)
                                      if f.filename.endswith(("engine_training.py", "hooks/stage3.py"))]
            engine.zero_grad()
            engine.save(os.path.join(folder, "checkpoint"))
            report["step_count_after"] = engine.step_count
            report["after"] = engine.full_state_dict()
    report["end"] = engine.full_state_dict()
    report["step_count_end"] = engine.step_count
    torch.save(report, os.path.join(folder, f"rank-{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
