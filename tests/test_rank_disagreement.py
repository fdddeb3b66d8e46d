"""Ranks that take different paths through the engine get an error on
every rank within seconds, naming each rank's position, never a silent
desync nor a wait for the timeout; a rank that is only slow trains on.

Each world (2 and 4 gloo ranks) runs every scenario at stages 0-3 in one
launch, each with an engine of its own. Rank 0 departs at step 1 of 3:
  full_state_dict, gathered_params, eval: calls it alone (`if rank == 0:`);
  forward_raises, backward_raises, user_raises: its forward, its backward
    or the user's code between them raises, and its loop skips the batch;
  slow: sleeps 3 x diagnose_after before its forward (trains on).
Config(diagnose_after=DIAGNOSE_AFTER) keeps the launch short (and
Config(timeout=TIMEOUT) bounds a failure); three run with the default
Config too (diagnose_after 5 s) at stage 3, at both world sizes. A rank that gets
RankDisagreementError checks that the engine refuses every later call with
it; rank 0 then waits, its process alive and in no collective, until every
rank has raised: where rank 0 runs into its peers' backward at stage 3
(eval, user_raises) they wait in the CPU data plane's ring reduce-scatter,
whose waits are not diagnosed in place, and raise within the bound because
rank 0 hangs up its groups (failure.hang_up), not because its
process ended. Last, Positions.diagnose's rule on
published records, in one process: a peer in another collective is apart,
one in none is slow and named by where it is or last was."""
import re
import time

import pytest
import torch
import torch.distributed as dist

import zerocore
from backward_call import CallInBackward
from dist_harness import run_ranks
from models import lm_batch, lm_loss, local, make
from zerocore.comm.positions import Positions

DIAGNOSE_AFTER = 0.3  # seconds
TIMEOUT = 20  # seconds: well past any bound asserted here
DEFAULT_DIAGNOSE_AFTER = zerocore.Config().diagnose_after
SLACK = 8.0  # seconds beyond diagnose_after an error may take on a loaded 2-core machine
STEPS, DEPART = 3, 1
STAGES = (0, 1, 2, 3)
# With the default Config at stage 3: rank 0 alone in full_state_dict(); its evaluation forward, with its peers
# waiting in the CPU reduce-scatter's ring of their backward (they learn of it as rank 0 hangs up); its sleep of
# 3 x diagnose_after (15 s: its peers look three times, and wait on).
DEFAULT_SCENARIOS = ("full_state_dict", "eval", "slow")
SCENARIOS = ("full_state_dict", "gathered_params", "eval", "forward_raises", "backward_raises", "user_raises", "slow")


class _Skipped(Exception):
    """The batch rank 0's loop skips."""


def _scenario(rank, world, stage, what, config):
    model = make()
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           {"stage": stage, "bucket_bytes": 2048, **config})
    step = 0

    def fail(*_):
        if rank == 0 and step == DEPART:
            raise _Skipped(what)

    if what == "forward_raises":
        model.blocks[1].register_forward_pre_hook(fail)
    elif what == "backward_raises":
        model.blocks[1].register_forward_hook(lambda m, args, out: CallInBackward.apply(out, fail))
    out = {"error": None, "raised": []}

    def note(e, step, start):
        out["raised"].append((step, type(e).__name__))
        if out["error"] is None and not isinstance(e, _Skipped):
            out.update(error=type(e).__name__, message=str(e), step=step, seconds=time.monotonic() - start)

    def train(step):
        x, y = lm_batch(step, 0, world)
        loss = lm_loss(engine(local(x, rank, world)), local(y, rank, world))
        if what == "user_raises":
            fail()
        engine.backward(loss)

    for step in range(STEPS):
        start = time.monotonic()
        if rank == 0 and step == DEPART:
            try:
                if what == "full_state_dict":
                    engine.full_state_dict()
                elif what == "gathered_params":
                    with engine.gathered_params():
                        pass
                elif what == "eval":
                    with torch.no_grad():
                        engine(local(lm_batch(0, 0, world)[0], rank, world))
                elif what == "slow":
                    time.sleep(3 * engine.config.diagnose_after)
            except zerocore.RankDisagreementError as e:
                note(e, step, start)
                out["refusals"] = _refusals(engine, str(e))
                _wait_for_the_peers(rank, world, (stage, what, config), start)
                break
        start = time.monotonic()
        try:
            train(step)  # a loop that skips the batch where its forward or backward raises
            engine.step()
            engine.zero_grad()
        except zerocore.RankDisagreementError as e:  # out of step: the job ends (here: the next scenario)
            note(e, step, start)
            out["refusals"] = _refusals(engine, str(e))
            _wait_for_the_peers(rank, world, (stage, what, config), start)
            break
        except zerocore.CollectiveOrderError as e:
            # Nothing was updated: zero_grad() on every rank, and a step trains with the ranks at one step.
            note(e, step, start)
            engine.zero_grad()
            step = STEPS
            train(step)
            engine.step()
            break
        except Exception as e:  # noqa: BLE001 - skip the batch
            note(e, step, start)
    out["step_count"] = engine.step_count
    if out["error"] != "RankDisagreementError":
        out["params"] = torch.cat([p.detach().reshape(-1) for p in engine.full_state_dict().values()])
    return out


def _wait_for_the_peers(rank, world, scenario, start):
    """After its RankDisagreementError rank 0 (which departed) goes on, its
    process alive and in no collective, until every rank has raised (or
    past the time they may take): a peer stuck where no diagnosis runs
    raises because rank 0 hung up, not because its process ended or it
    went on into another collective."""
    store, key = dist.distributed_c10d._get_default_store(), f"raised {scenario}"
    store.add(key, 1)
    while rank == 0 and store.add(key, 0) < world and time.monotonic() < start + 2 * (TIMEOUT + SLACK):
        time.sleep(0.05)


def _refusals(engine, message) -> dict:
    """Each call of the engine after its RankDisagreementError: what it
    raised ("refused" where that error, with its message)."""
    calls = {"forward": lambda: engine(torch.zeros(1, 4, dtype=torch.long)),
             "backward": lambda: engine.backward(torch.ones((), requires_grad=True)),
             "step": engine.step, "zero_grad": engine.zero_grad, "clip_grad_norm_": lambda: engine.clip_grad_norm_(1.0),
             "full_state_dict": engine.full_state_dict, "gathered_params": lambda: engine.gathered_params().__enter__(),
             "save": lambda: engine.save("never-written"), "close": engine.close}
    said = {}
    for name, call in calls.items():
        try:
            call()
            said[name] = "went on"
        except zerocore.RankDisagreementError as e:
            said[name] = "refused" if str(e) == message else f"another message: {e}"
        except Exception as e:  # noqa: BLE001 - reported
            said[name] = f"{type(e).__name__}: {e}"
    return said


def _scenarios(rank, world, which):
    results = {key: _scenario(rank, world, *key, {"diagnose_after": DIAGNOSE_AFTER, "timeout": TIMEOUT})
               for key in which}
    for what in DEFAULT_SCENARIOS:  # the default Config
        results["default", what] = _scenario(rank, world, 3, what, {})
    return results


def _expected(stage, what) -> str:
    """What every rank gets (the module's doc)."""
    if what == "slow" or (stage < 3 and what in ("gathered_params", "eval")) or (stage, what) == (0, "full_state_dict"):
        # No collective differs: stages 0-2 hold every param (stage 0 its optimizer state too); a forward without
        # grad is not counted.
        return "trains on"
    if stage == 3 and what in ("forward_raises", "backward_raises"):
        return "raise together"  # stage 3's rounds carry rank 0's failure: every rank raises in that call
    if stage < 3 and what != "full_state_dict":
        return "CollectiveOrderError"  # the next meeting (the step's, or stage 2's backward) counts differ
    return "RankDisagreementError"


@pytest.fixture(scope="module", params=[2, 4])
def world_results(request):
    world = request.param
    scenarios = [(stage, what) for stage in STAGES for what in SCENARIOS]
    return world, run_ranks(_scenarios, world, scenarios, timeout=150)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("what", SCENARIOS)
def test_every_rank_raises_naming_positions_or_trains_on(world_results, stage, what):
    world, results = world_results
    _check([r[stage, what] for r in results], world, stage, what, DIAGNOSE_AFTER)


@pytest.mark.parametrize("what", DEFAULT_SCENARIOS)
def test_default_config_names_the_ranks_within_seconds_or_waits_for_the_slow(world_results, what):
    world, results = world_results
    outs = [r["default", what] for r in results]
    _check(outs, world, 3, what, DEFAULT_DIAGNOSE_AFTER)
    for o in outs:  # an error came once the default diagnose_after had passed
        assert o["error"] is None or DEFAULT_DIAGNOSE_AFTER <= o["seconds"] + 0.5, o["seconds"]


def _check(outs, world, stage, what, diagnose_after):
    """Each rank's outcome of one scenario (_scenario's) is _expected's."""
    expected = _expected(stage, what)
    if expected == "trains on":
        assert [o["raised"] for o in outs] == [[]] * world, [o.get("message") for o in outs]
        assert [o["step_count"] for o in outs] == [STEPS] * world
        return
    assert outs[0]["raised"][0][0] == DEPART
    for rank, o in enumerate(outs):
        if expected == "raise together":  # rank 0 its own error, the others one naming its failure
            assert o["raised"] == [(DEPART, "_Skipped" if rank == 0 else "RuntimeError")], o.get("message")
            assert rank == 0 or "other rank(s) failed" in o["message"]
            continue
        assert o["error"] == expected, (rank, o.get("message"))
        assert o["seconds"] < diagnose_after + SLACK, (rank, o["seconds"])
        if expected == "RankDisagreementError":  # out of step: never half usable
            assert set(o["refusals"].values()) == {"refused"}, (rank, o["refusals"])
        names = "rank {r}: in " if expected == "RankDisagreementError" else "rank {r}: at the "
        assert all(names.format(r=r) in o["message"] for r in range(world)), o["message"]
        if what in ("full_state_dict", "gathered_params"):
            assert f"rank 0: in {what}()" in o["message"], o["message"]
    if expected != "RankDisagreementError":
        # Every rank skipped the same step: usable again, at one step, with the same params.
        assert len({o["step_count"] for o in outs}) == 1
        for o in outs[1:]:
            torch.testing.assert_close(o["params"], outs[0]["params"], rtol=0, atol=0)


# Positions.diagnose's rule, on records a peer published (a store of one process, no ranks).
def _positions(store, rank, queues, call=None):
    p = Positions(1.0, store, "t/", rank, 2)
    p.close()
    if call is not None:
        p.enter(call, 3)
    for queue, (count, in_flight) in queues.items():
        for i in range(count):
            p.started(queue, in_flight if i == count - 1 and in_flight else (0, 0, 0, i), lambda k: f"{queue} {k}")
            if i < count - 1 or not in_flight:
                p.finished(queue)
    p.publish()
    return p


@pytest.mark.parametrize("peer, apart", [
    ({"data": (5, (1, 0, 0, 99))}, True),  # another collective at this place of this queue
    ({"data": (4, None), "control": (3, (0, -1, 2, 1))}, True),  # one of another queue this rank has not started
    ({"data": (4, None), "control": (2, (0, -1, 2, 1))}, False),  # one this rank has started: it will come
    ({"data": (5, (0, 0, 0, 4))}, False),  # in this one
    ({"data": (4, None)}, False),  # in none: slow
])
def test_a_peer_in_another_collective_is_apart_one_in_none_is_slow(peer, apart):
    store = dist.HashStore()
    _positions(store, 1, peer, call="step()")
    me = _positions(store, 0, {"data": (5, (0, 0, 0, 4)), "control": (2, None)}, call="full_state_dict()")
    if apart:
        with pytest.raises(zerocore.RankDisagreementError, match=r"(?s)rank 0: in full_state_dict\(\), waiting "
                                                                 r".*rank 1: in step\(\) of step 3, waiting"):
            me.diagnose("data", 1.0)
        return
    said = me.diagnose("data", 1.0)
    assert (said is None) == (peer["data"][0] == 5), said
    if said is not None:
        assert said.startswith("rank 1 has not started it: in step() of step 3"), said


def test_a_peer_out_of_the_engine_is_named_by_its_last_call():
    store = dist.HashStore()
    peer = Positions(1.0, store, "t/", 1, 2)
    peer.close()
    peer.leave(peer.enter("forward", "2, micro-batch 1"))
    peer.publish()
    me = _positions(store, 0, {"data": (1, (0, 0, 0, 0))})
    assert re.fullmatch(r"rank 1 has not started it: in no call of the engine; last in forward of step 2, "
                        r"micro-batch 1, \d+\.\d s ago", me.diagnose("data", 1.0))


@pytest.mark.parametrize("value", [0, -1, "5", True, float("inf")])
def test_bad_diagnose_after(value):
    with pytest.raises(ValueError, match=r"diagnose_after=.*positive number of seconds"):
        zerocore.Config(diagnose_after=value)
