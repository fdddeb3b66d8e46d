"""Ranks that disagree are named within seconds where the data plane's
collectives complete on a device (NCCL's), not on the host: each is in
flight until done, and the host waits on device work behind them diagnose
(Positions.watch), on CPU through two seams.

- The backend's watched host wait, in one process: device work that never
  completes (a collective a Python transport holds) ends the wait with
  what the watch raises, after its slices; a slow one is waited for.
- The simulated device (ProcessGroupTransport.SIMULATED_DEVICE_QUEUES): on
  2 gloo ranks, the data plane's collectives complete off the host, on the
  queue's completing thread, as NCCL's on a GPU, and end only at this
  rank's own abort (a peer's abort does not end them, as a peer's
  ncclCommAbort does not end an NCCL kernel). Rank 0 departs at step 1 of
  3: alone in full_state_dict() (stages 1 and 3; the DDP habit), alone in
  an evaluation forward (stage 3), or its device slow (its data
  collectives' completion waits 3 x diagnose_after: trains on). Each
  error comes on every rank within diagnose_after and a few seconds,
  names each rank's position, and the engine refuses every later call.
On a GPU, tests/test_gpu_ranks.py runs rank 0 alone in full_state_dict()
over each real data plane (gloo's CUDA tensors, torch's NCCL,
Config(nccl="native")), several ranks on one GPU."""
import gc
import threading
import time

import pytest
import torch
import torch.distributed as dist

import zerocore
from dist_harness import run_ranks
from models import lm_batch, lm_loss, local, make
from test_rank_disagreement import _refusals, _wait_for_the_peers
from zerocore import _native
from zerocore.comm.positions import Positions
from zerocore.comm.process_group import ProcessGroupTransport

DIAGNOSE_AFTER = 0.3  # seconds
# Seconds: a collective's. The gloo works of an aborted simulated collective end by it, and until they do the
# engine's teardown may wait for them (gc.collect() between scenarios puts that wait outside the timed calls).
TIMEOUT = 4
SLACK = 8.0  # seconds beyond diagnose_after an error may take on a loaded 2-core machine
STEPS, DEPART = 3, 1
SCENARIOS = ((1, "full_state_dict"), (3, "full_state_dict"), (3, "eval"), (1, "slow_device"), (3, "slow_device"))
ALL_REDUCE = int(_native.CollectiveKind.ALL_REDUCE)


class _HeldTransport:
    """A Python transport of one rank whose collectives complete when
    `release` is set: device work stuck behind a collective."""

    rank, world_size = 0, 1

    def __init__(self):
        self.release = threading.Event()

    def all_reduce(self, key, tensor):
        return self.release.wait


def _held_collective(backend):
    transport = _HeldTransport()
    queue = _native.CommQueue(transport, backend)
    return transport, queue, queue.all_reduce((ALL_REDUCE, 0, 0, 3), torch.ones(3))


@pytest.mark.parametrize("wait", ["host_wait", "compute_waits"])
def test_a_watched_host_wait_ends_with_what_the_watch_raises(wait):
    backend = _native.CheckingBackend()
    transport, queue, event = _held_collective(backend)
    calls = []

    def stalled(waited):
        calls.append(waited)
        if len(calls) == 2:
            raise zerocore.RankDisagreementError("rank 0: in full_state_dict(); rank 1: in step() of step 2")

    backend.watch_host_waits(0.1, stalled)
    start = time.monotonic()
    with pytest.raises(zerocore.RankDisagreementError, match=r"rank 0: in full_state_dict\(\)"):
        event.wait() if wait == "host_wait" else event.compute_waits()
    assert calls == pytest.approx([0.1, 0.2])
    assert 0.2 <= time.monotonic() - start < 0.2 + SLACK
    transport.release.set()
    queue.close()


def test_a_slow_device_is_waited_for_and_an_unwatched_wait_is_whole():
    backend = _native.CheckingBackend()
    transport, queue, event = _held_collective(backend)
    calls = []
    backend.watch_host_waits(0.1, calls.append)
    threading.Timer(0.35, transport.release.set).start()
    event.wait()
    assert len(calls) >= 3 and calls == sorted(calls), calls  # looked each slice, and waited on
    backend.watch_host_waits(0.1, None)
    transport, queue, event = _held_collective(backend)
    threading.Timer(0.25, transport.release.set).start()
    event.wait()
    assert len(calls) >= 3 and len(calls) == len(set(calls))  # no watch: not called again
    queue.close()


@pytest.mark.parametrize("value", [0, -1])
def test_a_watch_needs_positive_seconds(value):
    with pytest.raises(ValueError, match="positive"):
        _native.CheckingBackend().watch_host_waits(value, print)


def _two_ranks(peer_waits: bool):
    """Rank 0 in full_state_dict() with an all-gather in flight on the device
    until the returned event is set; rank 1 in step(), waiting on the host in a
    control collective rank 0 has not started (peer_waits), or in none."""
    store, done = dist.HashStore(), threading.Event()
    me, peer = Positions(1.0, store, "t/", 0, 2), Positions(1.0, store, "t/", 1, 2)
    for p in (me, peer):
        p.close()  # its publishing thread: published here
        p.started("data", (0, 0, 0, 4), lambda k: "all_gather", lambda: True)  # done: not in flight
    me.enter("full_state_dict()", 2)
    me.started("data", (0, 0, 0, 8), lambda k: "all_gather", done.is_set)
    peer.enter("step()", 2)
    if peer_waits:
        peer.started("control", (0, -1, 5, 2), lambda k: "control all_gather")
    peer.publish()
    return me, done


def test_a_device_collective_is_in_flight_until_done_and_diagnosed_from_a_host_wait():
    me, done = _two_ranks(peer_waits=True)
    with pytest.raises(zerocore.RankDisagreementError, match=r"(?s)rank 0: in full_state_dict\(\), waiting .* in the "
                                                             r"all_gather.*rank 1: in step\(\) of step 2, waiting"):
        me.diagnose(None, 1.0)
    me, done = _two_ranks(peer_waits=False)
    assert me.diagnose(None, 1.0) is None  # the peer waits in nothing: slow, or computing
    me, done = _two_ranks(peer_waits=True)
    done.set()
    assert me.diagnose(None, 1.0) is None  # nothing in flight here: the device is only slow elsewhere


def _slow_device_at(depart: threading.Event):
    """Rank 0's simulated device takes 3 x diagnose_after for the first
    collective that completes once `depart` is set."""
    wait = ProcessGroupTransport.wait_on_device

    def slow(self, works):
        if depart.is_set():
            depart.clear()
            time.sleep(3 * DIAGNOSE_AFTER)
        wait(self, works)
    ProcessGroupTransport.wait_on_device = slow


def _count_device_diagnoses(out):
    """out["device_diagnoses"] counts the diagnoses of host waits on device work (Positions.watch's)."""
    diagnose = Positions.diagnose
    out["device_diagnoses"] = 0

    def counted(self, queue, waited):
        out["device_diagnoses"] += queue is None
        return diagnose(self, queue, waited)
    Positions.diagnose = counted


def scenario(rank, world, stage, what, device="cpu", config=None):
    model = make().to(device)
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           {"stage": stage, "bucket_bytes": 2048, "diagnose_after": DIAGNOSE_AFTER,
                            "timeout": TIMEOUT, **(config or {})})
    depart = threading.Event()
    out = {"error": None}
    if what == "slow_device":
        _count_device_diagnoses(out)
        if rank == 0:
            _slow_device_at(depart)

    def raised(e, start):
        out.update(error=type(e).__name__, message=str(e), seconds=time.monotonic() - start,
                   refusals=_refusals(engine, str(e)))
        _wait_for_the_peers(rank, world, (stage, what, "device"), start)

    for step in range(STEPS):
        start = time.monotonic()
        try:
            if rank == 0 and step == DEPART:
                if what == "full_state_dict":
                    engine.full_state_dict()
                elif what == "eval":
                    with torch.no_grad():
                        engine(local(lm_batch(0, 0, world)[0], rank, world).to(device))
                else:
                    depart.set()
            x, y = lm_batch(step, 0, world)
            engine.backward(lm_loss(engine(local(x, rank, world).to(device)), local(y, rank, world).to(device)))
            engine.step()
            engine.zero_grad()
        except zerocore.RankDisagreementError as e:
            raised(e, start)
            break
    out["step_count"] = engine.step_count
    if out["error"] is None:
        out["params"] = torch.cat([p.detach().reshape(-1).cpu() for p in engine.full_state_dict().values()])
    return out


def _scenarios(rank, world):
    ProcessGroupTransport.SIMULATED_DEVICE_QUEUES = ("data", "reductions")
    aborted = []  # the simulated device queues this rank aborted, in the scenario running
    abort = ProcessGroupTransport._abort_simulated_device

    def noted(self):
        aborted.append(self.queue)
        abort(self)
    ProcessGroupTransport._abort_simulated_device = noted
    results = {}
    for key in SCENARIOS:
        gc.collect()  # the last scenario's engine goes here
        results[key] = scenario(rank, world, *key)
        results[key]["aborted"] = sorted(set(aborted))
        aborted.clear()
    return results


@pytest.fixture(scope="module")
def results():
    return run_ranks(_scenarios, 2, timeout=150)


@pytest.mark.parametrize("stage, what", SCENARIOS)
def test_on_a_device_data_plane_every_rank_names_the_positions_or_trains_on(results, stage, what):
    outs = [r[stage, what] for r in results]
    if what == "slow_device":  # a slow device is not an error
        assert [o["error"] for o in outs] == [None, None], [o.get("message") for o in outs]
        assert [o["step_count"] for o in outs] == [STEPS] * 2
        assert sum(o["device_diagnoses"] for o in outs) > 0  # the host waited on the slow device, looked, and waited on
        torch.testing.assert_close(outs[1]["params"], outs[0]["params"], rtol=0, atol=0)
        assert [o["aborted"] for o in outs] == [[], []]
        return
    check_apart(outs, what)
    # Each rank aborted its own device collectives (the stuck rank's end only so).
    assert all("data" in o["aborted"] for o in outs), [o["aborted"] for o in outs]


def check_apart(outs, what):
    """Every rank raised RankDisagreementError within the bound, naming each rank's position, and refuses every call."""
    for rank, o in enumerate(outs):
        assert o["error"] == "RankDisagreementError", (rank, o)
        assert o["seconds"] < DIAGNOSE_AFTER + SLACK, (rank, o["seconds"])
        assert set(o["refusals"].values()) == {"refused"}, (rank, o["refusals"])
        assert all(f"rank {r}: in " in o["message"] for r in range(len(outs))), o["message"]
        if what == "full_state_dict":
            assert "rank 0: in full_state_dict(), waiting" in o["message"], o["message"]

