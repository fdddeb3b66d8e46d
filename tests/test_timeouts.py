"""A stuck peer ends in zerocore.CollectiveTimeoutError on every live rank
within the timeout (Config.timeout, or else the group's own) plus a few
seconds, naming the collective, and the engine fails at once on further
use; a dead peer fails at once. 2- and 4-rank worlds: rank 1 stops
responding in forward, backward or the step of step STALL, until every
live rank is done (or TIMEOUT + 8 s), then raises _Stalled."""
import datetime
import multiprocessing
import threading
import re
import time

import pytest
import torch
import torch.distributed as dist

import zerocore
from backward_call import CallInBackward
from dist_harness import RankError, run_ranks
from models import lm_batch, lm_loss, local, make
from zerocore import _native

TIMEOUT = 2  # seconds
STALL = 1  # the step in which rank 1 stops responding


class _Stalled(Exception):
    pass


def _train_step(engine, rank, world, step):
    x, y = lm_batch(step, 0, world)
    engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    engine.step()
    engine.zero_grad()


def _all_live_ranks_done(done):
    """Waits, at most TIMEOUT + 8 s, until every rank is here: rank 1 stays
    stuck until then, so that no live rank sees it leave (a dead peer)."""
    try:
        done.wait(TIMEOUT + 8)
    except threading.BrokenBarrierError:
        pass


def _stuck_peer(rank, world, done, stage, where, offload, inherit):
    """Trains until a collective raises. Rank 1 stalls at step STALL, in
    `where`; every other rank reports how long the failing step took, the
    error, and what a further step raised (and how fast)."""
    config, group = {"stage": stage, "bucket_bytes": 2048, **OFFLOAD[offload]}, None
    if inherit:  # the engine's groups take the timeout of the group it is given
        group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=TIMEOUT))
    else:  # Config.timeout overrides the default group's 60 s
        config["timeout"] = TIMEOUT
    model = make()
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config, group=group)
    step = 0

    def stall(*_):
        if rank == 1 and step == STALL:
            _all_live_ranks_done(done)
            raise _Stalled(where)

    if where == "forward":
        model.blocks[1].register_forward_pre_hook(stall)
    elif where == "backward":
        model.blocks[1].register_forward_hook(lambda m, args, out: CallInBackward.apply(out, stall))
    else:  # the step: just before its one native call (stages 2-3: between the reduction and the exchange)
        carry_param_writes = engine._carry_param_writes
        engine._carry_param_writes = lambda: stall() or carry_param_writes()
    try:
        for step in range(STALL + 1):
            start = time.monotonic()
            try:
                _train_step(engine, rank, world, step)
            except zerocore.CollectiveTimeoutError as e:
                out = {"step": step, "seconds": time.monotonic() - start, "error": str(e)}
                start = time.monotonic()
                try:
                    _train_step(engine, rank, world, step + 1)
                except Exception as again:  # noqa: BLE001 - reported
                    out["again"] = (type(again).__name__, str(again), time.monotonic() - start)
                return out
        return {"step": None}
    finally:
        if rank != 1:
            _all_live_ranks_done(done)


OFFLOAD = {None: {}, "optimizer": {"offload_optimizer": "cpu"},
           # the delay from step 0 on: step STALL's collectives run beside step 0's update on the host
           "optimizer, delayed": {"offload_optimizer": "cpu", "delayed_update": True, "delayed_update_warmup": 0},
           "optimizer and params": {"offload_optimizer": "cpu", "offload_params": "cpu"}}
# (world, stage, where rank 1 stalls, offload, inherit the given group's timeout)
CASES = [(2, stage, where, None, False) for stage in (1, 2, 3) for where in ("forward", "backward", "step")] + [
    (2, 2, "step", "optimizer", False),
    (2, 3, "backward", "optimizer", False),
    (2, 2, "step", "optimizer, delayed", False),
    (2, 3, "backward", "optimizer, delayed", False),
    (2, 3, "forward", "optimizer and params", False),
    (2, 3, "step", "optimizer and params", False),
    (2, 3, "forward", None, True),  # the timeout of the group given to wrap
    (2, 1, "step", None, True),
    (4, 3, "backward", None, False),  # every live rank raises, not only rank 1's neighbours
    (4, 2, "step", None, True),
]


@pytest.mark.parametrize("world,stage,where,offload,inherit", CASES)
def test_a_stuck_peer_raises_within_the_timeout(world, stage, where, offload, inherit):
    done = multiprocessing.get_context("fork").Barrier(world)
    results = run_ranks(_stuck_peer, world, done, stage, where, offload, inherit, raise_errors=False,
                        timeout=TIMEOUT + 40)
    assert isinstance(results[1], RankError), results[1]
    for rank, live in enumerate(results):
        if rank == 1:
            continue
        assert isinstance(live, dict), (rank, live)
        assert live["step"] == STALL, (rank, live)
        assert TIMEOUT * 0.9 <= live["seconds"] <= TIMEOUT + 5, (rank, live)
        # It names the collective: its kind, and its params or what a control one is for.
        assert re.search(r"^zerocore: the (all_gather|reduce_scatter|all_reduce|broadcast) of the params \S+"
                         r"|^zerocore: the control \w+ of (stage 3's round|the step's norm exchange|backward's"
                         r"|the ranks' micro-batch counts)",
                         live["error"]), (rank, live["error"])
        peers = [r for r in range(world) if r != rank]
        assert f"timed out after {TIMEOUT:g} s waiting for rank(s) {peers}" in live["error"], (rank, live["error"])
        if world == 2:  # and where the peer it waited for was (zerocore/comm/positions.py)
            assert "(rank 1 has not started it: in " in live["error"], (rank, live["error"])
        if where == "step":  # rank 1 stalls before the step's first control collective, the ranks' meeting
            waited = "control all_gather of the ranks' micro-batch counts"
            assert waited in live["error"], (rank, live["error"])
        # The engine is left failing at once (with the first timeout of the
        # queue it reaches: another may have timed out beside this one).
        kind, message, seconds = live["again"]
        assert kind == "CollectiveTimeoutError" and f"timed out after {TIMEOUT:g} s" in message and seconds < 1.5, \
            (rank, live["again"])


def _dead_peer(rank, world):
    """Rank 1 leaves after the first step (its process ends); rank 0 goes on."""
    model = make()
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"stage": 3, "timeout": 60})
    _train_step(engine, rank, world, 0)
    if rank == 1:
        return None
    start = time.monotonic()
    try:
        _train_step(engine, rank, world, 1)
    except Exception as e:  # noqa: BLE001 - reported
        return type(e).__name__, str(e), time.monotonic() - start
    return None


def test_a_dead_peer_fails_at_once():
    kind, message, seconds = run_ranks(_dead_peer, 2, timeout=60)[0]
    assert seconds < 10, (kind, message, seconds)
    assert kind == "RuntimeError" and "timed out" not in message, (kind, message)


def _group_timeouts(rank, world):
    from zerocore.comm.process_group import group_timeout

    def timeouts(config, group=None):
        model = make()
        engine = zerocore.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), config, group=group)
        return [group_timeout(c.group).total_seconds() for c in (engine.comm, engine.control, engine.rounds_comm)]

    seven = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=7))
    return (timeouts({"stage": 3}), timeouts({"stage": 3}, seven),
            timeouts({"stage": 3, "timeout": datetime.timedelta(seconds=5)}, seven))


def test_the_engines_groups_take_the_given_groups_timeout_or_the_configs():
    for result in run_ranks(_group_timeouts, 2):
        assert result == ([60] * 3, [7] * 3, [5] * 3)  # run_ranks' default group has 60 s


@pytest.mark.parametrize("value", [0, -1.5, "2", True, float("nan"), datetime.timedelta(0)])
def test_bad_timeouts(value):
    with pytest.raises(ValueError, match=r"timeout=.*positive number of seconds or a datetime.timedelta"):
        zerocore.Config(timeout=value)


def test_timeouts_are_timedeltas():
    assert zerocore.Config(timeout=2.5).timeout == datetime.timedelta(seconds=2.5)
    assert zerocore.Config(timeout=datetime.timedelta(minutes=1)).timeout.total_seconds() == 60
    assert zerocore.Config().timeout is None


class _TimingOut:
    rank, world_size = 0, 1

    def __init__(self):
        self.keys = []

    def all_reduce(self, key, tensor):
        self.keys.append(key)
        raise TimeoutError(f"zerocore: the collective {key} timed out")


def _timeout_comes_out_as_is():
    transport = _TimingOut()
    q = _native.CommQueue(transport, _native.process_backend())
    t = torch.zeros(4)
    with pytest.raises(zerocore.CollectiveTimeoutError, match=r"^zerocore: the collective \(2, 5, 1, 4\) timed out$"):
        q.all_reduce((2, 5, 1, 4), t).wait()
    with pytest.raises(TimeoutError, match=r"\(2, 5, 1, 4\) timed out"):  # later ones fail with it, unrun
        q.all_reduce((2, 5, 2, 4), t).wait()
    assert transport.keys == [(2, 5, 1, 4)]
    assert issubclass(zerocore.CollectiveTimeoutError, RuntimeError)


def test_a_transports_timeout_comes_out_as_collective_timeout_error():
    run_ranks(lambda rank, world: _timeout_comes_out_as_is(), 1, timeout=30)
