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

A queue whose collectives complete on the device (NCCL: torch's, or the
native transport's) keeps each collective in flight from its issue until
its work is done (the torch Work, the transport's event), the oldest one
published as the queue's: the host never waits in them, so the host waits
on device work behind them (the backend's, watched: watch) diagnose
instead, over every queue this rank has a collective in flight on.
"""
from __future__ import annotations

import collections
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
# id(backend) -> the Positions whose watch its host waits run (Positions.watch): the last engine's.
_WATCHING = {}


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
        self.queues = {}  # queue name -> _Queue
        self._watched = None  # the backend whose host waits this diagnoses (watch)
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
        backend, self._watched = self._watched, None
        if backend is not None and _WATCHING.get(id(backend)) is self:  # not a later engine's watch
            del _WATCHING[id(backend)]
            backend.watch_host_waits(self.diagnose_after, None)

    def watch(self, backend, failure):
        """The host waits of `backend` (the engine's) that wait
        diagnose_after on device work diagnose (diagnose(None, ...)), and again
        each diagnose_after: ranks in different collectives end the wait
        with RankDisagreementError (recorded in `failure`, the engine's
        failure.Failure, which aborts this rank's device collectives);
        so does an earlier failure of the engine's collectives. Waits on a
        merely slow device go on. The backend keeps the last engine's watch
        (the process's CPU backend serves every engine of the process)."""
        if self.store is None or self.world_size == 1:
            return

        def stalled(waited):
            failure.check()
            try:
                self.diagnose(None, waited)
            except RankDisagreementError as e:
                failure.record(RankDisagreementError, str(e))
                raise
        backend.watch_host_waits(self.diagnose_after, stalled)
        self._watched = backend
        _WATCHING[id(backend)] = self

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

    def started(self, queue: str, key, describe, done=None):
        """Queue `queue` has started the collective `key`; describe(key)
        names it (called only to publish: the hot path formats nothing).
        done: None for a collective the host waits in (finished() ends
        it); else a callable saying, without blocking, whether its work is
        done (a device's), asked when the positions are read."""
        q = self.queues.get(queue)
        if q is None:
            q = self.queues[queue] = _Queue()
        q.count += 1
        q.flight.append((q.count, key, describe, time.time(), done))
        q.settle()

    def finished(self, queue: str):
        """The oldest collective in flight on `queue` (one the host waited in) is done."""
        self.queues[queue].flight.popleft()

    def follow(self, queue: str, progress, describe):
        """Queue `queue`'s collectives are noted by its transport
        (the native NCCL one): progress() returns (collectives issued, the
        number of the oldest not done or 0, its key, seconds since it
        became the oldest)."""
        self.queues[queue] = _Queue(progress, describe)

    # Publishing ----------------------------------------------------------------
    def _record(self) -> dict:
        return {"call": self.call and self._call_name(self.call, self.step), "since": self.since,
                "last": self.last, "left": self.left,
                "queues": {name: q.record() for name, q in self.queues.items()}}

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

    def diagnose(self, queue: Optional[str], waited: float) -> Optional[str]:
        """This rank's collective on `queue` has waited `waited` seconds
        (None: the host has waited that long for device work, in the
        backend's watched host wait): raises RankDisagreementError (also on
        each peer involved, which finds the same) where a peer waits in a
        collective other than one this rank has in flight, on any queue;
        otherwise returns what the peers that have not started this rank's
        collective on `queue` are doing (None: all have, or no queue),
        for a timeout's message. A device whose work is only slow, or waits
        for a peer that is, is no error."""
        records = self._read()
        in_flight = [name for name, q in records[self.rank]["queues"].items() if q[1] is not None]
        self._raise_if_apart(sorted({r for name in in_flight for r in self._apart(name, records)[0]}), records,
                             waited)
        absent = self._apart(queue, records)[1] if queue is not None else []
        if not absent:
            return None
        now = time.time()
        return "; ".join(f"rank {r} has not started it: {_where(records[r], now)}" for r in absent)

    def _read(self) -> dict:
        """Every rank's record, this rank's published first; raises the
        RankDisagreementError a peer found first, if one did (every rank
        raises its message, with the positions it saw)."""
        self.publish()
        apart = self.found_apart()
        if apart is not None:
            raise RankDisagreementError(apart)
        return {self.rank: self._record(), **self._peers()}

    def _apart(self, queue: str, records: dict) -> tuple:
        """(the peers in a different collective than this rank's in flight
        on `queue`, those that have not started it and wait in none this
        rank has not started), from every rank's record."""
        mine = records[self.rank]
        key, index = mine["queues"][queue][1], mine["queues"][queue][4]
        apart, absent = [], []
        for r, rec in records.items():
            if r == self.rank:
                continue
            theirs = rec["queues"].get(queue, _Queue.NONE) if rec else None
            if theirs is not None and theirs[0] >= index:
                if theirs[4] == index and theirs[1] is not None and theirs[1] != key:
                    apart.append(r)  # another collective of this queue at the same place
                continue
            if rec is not None and any(s[1] is not None and s[4] > mine["queues"].get(q, _Queue.NONE)[0]
                                       for q, s in rec["queues"].items()):
                apart.append(r)  # it waits in a collective this rank has not started, and has not started this one
            else:
                absent.append(r)
        return apart, absent

    def _raise_if_apart(self, apart: list, records: dict, waited: float):
        if apart:
            now = time.time()
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


class _Queue:
    """One queue's collectives, as Positions keeps them: how many started,
    and those in flight, oldest first, each (its number, key, describe,
    since, done: see Positions.started); or, followed (Positions.follow),
    its transport's progress."""

    NONE = [0, None, None, 0.0, 0]  # the record of a queue that started none

    def __init__(self, progress=None, describe=None):
        self.count, self.flight = 0, collections.deque()
        self.progress, self.describe = progress, describe

    def settle(self):
        """Drops the collectives whose device work is done: those at the
        front, or all once the newest is (a queue's complete in its order;
        so one whose done() lags does not hold the rest, nor their tensors)."""
        if self.flight and _done(self.flight[-1]):
            self.flight.clear()
        while self.flight and _done(self.flight[0]):
            self.flight.popleft()

    def record(self) -> list:
        """[collectives started, key of the oldest in flight or None, what
        names it, since when, its number]."""
        if self.progress is not None:
            count, index, key, seconds = self.progress()
            if not index:
                return [count, None, None, 0.0, 0]
            return [count, list(key), self.describe(tuple(key)), time.time() - seconds, index]
        self.settle()
        if not self.flight:
            return [self.count, None, None, 0.0, 0]
        index, key, describe, since, _ = self.flight[0]
        return [self.count, list(key), describe(key), since, index]


def _done(collective) -> bool:
    """Whether a collective in flight (_Queue.flight's) is done on the device (one the host waits in: never here)."""
    done = collective[4]
    return done is not None and done()


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
    """Decorates a method of an engine's part that holds `parts` (its
    EngineParts) and `progress` (the TrainingLoop's StepProgress): while it
    runs, the rank's position is `name` (Positions.enter) of the engine's
    step and, with micro_batch, micro-batch (forward, backward); not while
    torch.compile traces it. After a failed collective (the ranks out of
    step: a RankDisagreementError, a timeout) it refuses, raising that
    error again: the engine is never half usable."""
    def decorate(method):
        @functools.wraps(method)
        def noted(self, *args, **kwargs):
            if torch.compiler.is_compiling():
                return method(self, *args, **kwargs)
            self.parts.comm.failure.check()
            step = self.progress.step_count + 1
            with self.parts.positions.inside(
                    name, f"{step}, micro-batch {self.progress.backward_calls + 1}" if micro_batch else step):
                return method(self, *args, **kwargs)
        return noted
    return decorate
