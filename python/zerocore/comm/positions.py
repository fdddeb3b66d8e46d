"""Where each rank is in the engine, readable by its peers, so that a
collective that waits long tells ranks in different collectives (an error
at once, on every rank involved, naming each rank's position) from a peer
that is merely slow (still computing, in its data loader: wait on, until
the timeout).

A rank's position is the engine call it is in (forward, backward or the
step of step n, full_state_dict(), gathered_params(), save, ...: set by the
engine's methods, two attribute writes a call) or the one it was last in
and when it left, and for each of its queues over torch.distributed
(process_group.ProcessGroupTransport) how many collectives it has started
and the one in flight, since when. A thread of the engine publishes it in
torch.distributed's store, once it changed, at most every PUBLISH_PERIOD:
the hot path never touches the store. A transport whose collective has
waited Config.diagnose_after publishes its own position at once and reads
its peers' (Positions.diagnose): a peer that waits in a collective this
rank has not started (another one of this queue at the same place, or one
of another queue), while it has not started this rank's, is in a different
collective. Every rank issues the engine's collectives in one order, so
that is never a race: this rank issued its collective first and the peer
its own, so neither can go on, and each finds the other the same way,
whichever waited longer. A peer that started neither is slow, or stopped in
the user's code: the wait goes on, and a timeout names where it last was.
"""
from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from zerocore.comm.errors import RankDisagreementError

PUBLISH_PERIOD = 0.5  # seconds, at most, between a change of position and its publication


class Positions:
    """This rank's position in one engine (the module's doc), and its
    peers' as they published them. rank, world_size: in the engine's
    groups (all of one set of ranks); store: torch.distributed's, where
    the positions live under `prefix` (the same on every rank, one per
    engine); None: no peers to publish to (a rank alone), and calls are
    only noted."""

    def __init__(self, diagnose_after: float, store=None, prefix: str = "", rank: int = 0, world_size: int = 1):
        self.diagnose_after = diagnose_after
        self.store, self.prefix, self.rank, self.world_size = store, prefix, rank, world_size
        self.call, self.step, self.since = None, 0, time.time()  # the call it is in (None: none), from when
        self.last, self.left = None, None  # the call it was last in, and when it left it
        # queue name -> [collectives started, key of the one in flight or None, what names it, since]
        self.queues = {}
        self._published = None
        self._stop = threading.Event()
        if store is not None and world_size > 1:
            self.publish()
            threading.Thread(target=self._publishing, name="zerocore-positions", daemon=True).start()

    @classmethod
    def of(cls, group, diagnose_after: float) -> "Positions":
        """The Positions of an engine whose control group is `group` (None:
        a rank alone); its name, the same on every rank, keys the store."""
        if group is None or dist.get_world_size(group) == 1:
            return cls(diagnose_after)
        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, AttributeError, ValueError):  # no store to publish to: calls are only noted
            return cls(diagnose_after)
        return cls(diagnose_after, store, f"zerocore/positions/{group.group_name}/", dist.get_rank(group),
                   dist.get_world_size(group))

    def close(self):
        self._stop.set()

    # What the engine and its transports note ------------------------------------
    def enter(self, call: str, step) -> tuple:
        """The rank is in `call` (its name, as "full_state_dict()") of step
        `step` (the one it works toward: step_count + 1, or a description:
        "2, micro-batch 3") now; returns what leave() takes back."""
        before = (self.call, self.step, self.since)
        if self.call is None:
            self.call, self.step, self.since = call, step, time.time()
        return before

    def leave(self, before: tuple):
        """The call entered (enter's return) has ended: the rank is back
        where it was (a call of the engine that called it, or none)."""
        if before[0] is None and self.call is not None:
            self.last, self.left = self._call_name(self.call, self.step), time.time()
        self.call, self.step, self.since = before

    @contextlib.contextmanager
    def inside(self, call: str, step):
        """The rank is in `call` of step `step` while inside."""
        before = self.enter(call, step)
        try:
            yield
        finally:
            self.leave(before)

    def started(self, queue: str, key, describe):
        """Queue `queue` has started the collective `key`; describe(key)
        names it (called only to publish: the hot path formats nothing)."""
        state = self.queues.setdefault(queue, [0, None, None, 0.0])
        state[0] += 1
        state[1:] = key, describe, time.time()

    def finished(self, queue: str):
        self.queues[queue][1:3] = None, None

    # Publishing ----------------------------------------------------------------
    def _record(self) -> dict:
        return {"call": self.call and self._call_name(self.call, self.step), "since": self.since,
                "last": self.last, "left": self.left,
                "queues": {q: [n, key and list(key), key and describe(key), since]
                           for q, (n, key, describe, since) in self.queues.items()}}

    @staticmethod
    def _call_name(call, step):
        return f"{call} of step {step}" if call in ("forward", "backward", "step()") else call

    def publish(self):
        record = json.dumps(self._record())
        if record != self._published:
            self.store.set(self.prefix + str(self.rank), record)
            self._published = record

    def _publishing(self):
        while not self._stop.wait(min(PUBLISH_PERIOD, self.diagnose_after / 4)):
            try:
                self.publish()
            except Exception:  # noqa: BLE001 - the store gone (the job ending): nothing left to publish to
                return

    def _peers(self) -> dict:
        """Each peer's last published record (None: none yet)."""
        out = {}
        for r in range(self.world_size):
            if r == self.rank:
                continue
            key = self.prefix + str(r)
            out[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return out

    # Diagnosing ------------------------------------------------------------------
    def found_apart(self) -> Optional[str]:
        """The message of the RankDisagreementError a rank of this engine
        found, if one did (None: none): a collective that fails because
        the peer that found it left (its process ending) raises it, not the
        error of a peer gone."""
        key = self.prefix + "apart"
        if self.store is None or not self.store.check([key]):
            return None
        return self.store.get(key).decode()

    def diagnose(self, queue: str, waited: float) -> Optional[str]:
        """This rank's collective on `queue` has waited `waited` seconds:
        raises RankDisagreementError (also on each peer involved, which
        finds the same) where a peer waits in a different collective;
        otherwise returns what the peers that have not started it are doing
        (None: all have), for a timeout's message."""
        self.publish()
        apart = self.found_apart()  # by a peer first: every rank raises its message, with the positions it saw
        if apart is not None:
            raise RankDisagreementError(apart)
        mine = self._record()
        started, key, name, _ = mine["queues"][queue]
        now = time.time()
        records = {self.rank: mine, **self._peers()}
        apart, absent = [], []
        for r, rec in records.items():
            if r == self.rank:
                continue
            theirs = rec["queues"].get(queue, [0, None, None, 0.0]) if rec else None
            if theirs is not None and theirs[0] >= started:
                if theirs[0] == started and theirs[1] is not None and theirs[1] != key:
                    apart.append(r)  # another collective of this queue at the same place
                continue
            if rec is not None and any(s[1] is not None and s[0] > mine["queues"].get(q, [0])[0]
                                       for q, s in rec["queues"].items()):
                apart.append(r)  # it waits in a collective this rank has not started, and has not started this one
            else:
                absent.append(r)
        if apart:
            ranks = "\n".join(f"  rank {r}: {_where(records[r], now)}" for r in sorted(records))
            message = (
                f"zerocore: the ranks are in different collectives of the engine (found after {waited:.1f} s, "
                f"Config(diagnose_after={self.diagnose_after:g})):\n{ranks}\nEvery rank must call the engine's "
                "collectives in the same order: forward and engine.backward as often between steps, step(), and "
                "full_state_dict(), gathered_params(), save() and load() on every rank (save on rank 0 alone what "
                "full_state_dict() returns on every rank). The ranks are out of step now: every later call of "
                "this engine fails at once, so end the job and restart it from a checkpoint.")
            # For the peers: the first message found is every rank's (compare_set keeps it).
            message = self.store.compare_set(self.prefix + "apart", "", message).decode()
            raise RankDisagreementError(message)
        if not absent:
            return None
        return "; ".join(f"rank {r} has not started it: {_where(records[r], now)}" for r in absent)


def _where(record: Optional[dict], now: float) -> str:
    """A rank's position, in words, from its record."""
    if record is None:
        return "it has published no position yet"
    waiting = [(s[2], now - s[3]) for s in record["queues"].values() if s[1] is not None]
    if record["call"] is not None:
        where = f"in {record['call']}"
        if waiting:
            what, seconds = max(waiting, key=lambda w: w[1])
            return f"{where}, waiting {seconds:.1f} s in the {what}"
        return f"{where} (for {now - record['since']:.1f} s), in no collective"
    if record["last"] is None:
        return "in no call of the engine yet"
    return f"in no call of the engine; last in {record['last']}, {now - record['left']:.1f} s ago"


def engine_call(name: str, micro_batch=False):
    """Decorates an engine method: while it runs, the rank's position is
    `name` (Positions.enter) of the engine's step and, with micro_batch,
    micro-batch (forward, backward); not while torch.compile traces it.
    After a failed collective (the ranks out of step: a
    RankDisagreementError, a timeout) it refuses, raising that error again:
    the engine is never half usable."""
    def decorate(method):
        @functools.wraps(method)
        def noted(self, *args, **kwargs):
            if torch.compiler.is_compiling():
                return method(self, *args, **kwargs)
            self.comm.failure.check()
            step = self.step_count + 1
            with self.positions.inside(name, f"{step}, micro-batch {self._backward_calls + 1}" if micro_batch
                                       else step):
                return method(self, *args, **kwargs)
        return noted
    return decorate
