"""The training job of test_snapshots.py: run by torchrun (python -m
torch.distributed.run) with in-memory snapshots, or, as `train`, on
dist_harness's ranks for the uninterrupted references.

Every step's data and noise are a function of (step, rank) and the
restored RNG state, so a run restored at step k goes on exactly as the
uninterrupted one. A first attempt (TORCHELASTIC_RESTART_COUNT 0) may kill
one rank with SIGKILL at a place of one step (--kill RANK:STEP:PLACE):
"forward", "backward", "step", or "snapshot" (while it writes the snapshot
of that step, behind the next step's forward: its file half-written);
--lose-dir: that rank's snapshot folder goes with it (its node lost).
--node-per-rank: each rank's snapshot folder under --dir is its own, as
on a node of its own (what a rank lacks travels over the group).

    python -m torch.distributed.run --nproc-per-node 3 --max-restarts 1 tests/snapshot_job.py \\
        --steps 8 --dir D --run-id R --out OUT [--kill 1:5:forward] [--lose-dir]

Each rank writes OUT/rank-R.json (restored step, restart count, or the
error wrap raised); rank 0 OUT/params.pt (the full params at the end).
"""
import argparse
import datetime
import faulthandler
import json
import os
import shutil
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

import zerocore
from zerocore.io import snapshot

STAGE = 3


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)


def config(**fields):
    return zerocore.Config(**{"stage": STAGE, "bucket_bytes": 256, **fields})


def scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.3 * s))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def run_steps(engine, sched, first, last, before=lambda step, place: None):
    """Steps first..last (1-based), each: forward, backward, step, zero_grad, the scheduler."""
    rank = engine.comm.rank
    for step in range(first, last + 1):
        x, y = batch(step, rank)
        x = x + 0.01 * torch.randn_like(x)  # the RNG restored too
        before(step, "forward")
        loss = nn.functional.mse_loss(engine(x), y)
        before(step, "backward")
        engine.backward(loss)
        before(step, "step")
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        sched.step()


def train(rank, world, steps, save_at=None, load=None, fields=None):
    """The uninterrupted reference on dist_harness's ranks (no snapshots,
    unless `fields` of Config ask): steps 1..steps, or from the step after
    the one snapshots restore; save_at (step, folder): a checkpoint after
    that step; load (step, folder): start from that checkpoint, after that
    step. Returns the full params and the step restored."""
    torch.manual_seed(1 + rank)
    model, opt = model_and_optimizer()
    fields = dict(fields or {})
    if "snapshot_dir" in fields:  # "{rank}" in it: each rank a node of its own; "{pair}": two ranks a node
        fields["snapshot_dir"] = fields["snapshot_dir"].format(rank=rank, pair=rank // 2)
    engine = zerocore.wrap(model, opt, config(**fields))
    sched = scheduler(opt)
    first = 1
    if engine.snapshots:
        engine.snapshot_lr_scheduler(sched)
        first = engine.restored_step + 1
    if load:
        engine.load(load[1], lr_scheduler=sched)
        first = load[0] + 1
    last = save_at[0] if save_at else steps
    run_steps(engine, sched, first, last)
    if save_at:
        engine.save(save_at[1], lr_scheduler=sched)
        return None
    state = engine.full_state_dict()
    engine.close()
    return state, first - 1


def _killer(args, rank, run):
    """The `before` of run_steps that kills this rank where --kill says (first attempt only)."""
    if not args.kill or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return lambda step, place: None
    who, when, where = args.kill.split(":")
    if int(who) != rank:
        return lambda step, place: None

    def die():
        if args.lose_dir:
            shutil.rmtree(snapshot.holder_dir(run, rank), ignore_errors=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "snapshot":  # the snapshot of step `when`, killed half-written: its data, not its header
        seal = snapshot.Snapshots._seal_file

        def seal_or_die(snapshots, step, *a):
            if step == int(when):
                die()
            seal(snapshots, step, *a)
        snapshot.Snapshots._seal_file = seal_or_die
        return lambda step, place: None
    return lambda step, place: die() if (step, place) == (int(when), where) else None


def init_restartable():
    """init_process_group under torchrun, with the launcher's store seen
    under a prefix of the attempt: torch 2.13's torchrun keeps its store
    across restarts, where a restarted gloo group would otherwise read the
    dead attempt's addresses (connectFullMesh: connection refused)."""
    env = os.environ
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{env['TORCHELASTIC_RESTART_COUNT']}", store),
                            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=60))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kill")
    p.add_argument("--lose-dir", action="store_true")
    p.add_argument("--node-per-rank", action="store_true", help="each rank a node: a snapshot folder of its own")
    p.add_argument("--save-at", type=int, help="a disk checkpoint after this step, into --out/checkpoint")
    p.add_argument("--stacks-after", type=float, default=240)
    args = p.parse_args()
    faulthandler.dump_traceback_later(args.stacks_after, exit=True)  # a hang shows where, in the job's output
    torch.set_num_threads(1)
    init_restartable()
    rank = dist.get_rank()
    torch.manual_seed(1 + rank)
    model, opt = model_and_optimizer()
    report = {"restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    try:
        folder = os.path.join(args.dir, f"node-{rank}") if args.node_per_rank else args.dir
        engine = zerocore.wrap(model, opt, config(snapshot="memory", snapshot_dir=folder,
                                                  snapshot_run_id=args.run_id))
    except zerocore.SnapshotLostError as e:
        report["error"] = str(e)
        with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
            json.dump(report, f)
        sys.exit(3)
    sched = scheduler(opt)
    engine.snapshot_lr_scheduler(sched)
    report["restored_step"] = engine.restored_step
    report["fetched"] = engine.snapshots.fetched
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
        json.dump(report, f)
    killer = _killer(args, rank, snapshot.run_dir(engine.config))
    first = engine.restored_step + 1
    if args.save_at and first <= args.save_at:
        run_steps(engine, sched, first, args.save_at, killer)
        engine.save(os.path.join(args.out, "checkpoint"), lr_scheduler=sched)
        first = args.save_at + 1
    run_steps(engine, sched, first, args.steps, killer)
    state = engine.full_state_dict()
    engine.snapshots.wait()
    report["memory_report"] = engine.memory_report()
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
        json.dump(report, f)
    engine.close()
    if rank == 0:
        torch.save(state, os.path.join(args.out, "params.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
