"""After any failed collective the ranks are out of step, so the
transports of one engine share a Failure: every later collective, on any of its groups, fails
at once with the first error instead of waiting for a peer. Where the
first is a RankDisagreementError (zerocore/comm/positions.py), the rank also
hangs up its gloo groups (hang_up): a peer waiting in the ring's sends and
receives, which cannot be waited in slices and so are never diagnosed in
place, fails at once and raises the error found, then hangs up in turn. Its
device collectives (NCCL: torch's group, or the native transport's
communicator) it aborts, so that its own device work stuck in them ends
(a peer's abort does not end it: each rank finds the disagreement in its
own host wait, Positions.watch).
"""
import datetime
import threading

import torch
import torch.distributed as dist

from zerocore._native import CollectiveTimeoutError
from zerocore.comm.errors import RankDisagreementError


class Failure:
    """The first failed collective of the transports that share this. Only
    its type and message are kept: the exception's traceback would hold the
    queue's tensors. Once it is a RankDisagreementError, this rank hangs up
    its gloo groups (hang_up), so that no peer waits for it, and aborts its
    device collectives, so that its own device work stuck in them ends."""

    def __init__(self):
        self.error_type, self.message = None, None
        # What the sharing transports do once the ranks are found apart: hang up a gloo group, abort NCCL's.
        self.on_apart = []
        # Held while the first failure is recorded: check() raises it once this rank's ends ran (and another
        # thread's record waits for them). Reentrant: an end may fail a collective of this rank, which records.
        self._recording = threading.RLock()

    def record(self, error_type, message: str):
        """error_type: CollectiveTimeoutError or RankDisagreementError,
        raised again as itself; anything else, as a RuntimeError."""
        with self._recording:
            if self.message is None:
                self.error_type, self.message = error_type, message
                if error_type is RankDisagreementError:
                    for end in self.on_apart:
                        end()

    def check(self):
        """Raises the first failure again."""
        if self.message is not None:
            with self._recording:  # its ends done
                pass
        if self.error_type in (CollectiveTimeoutError, RankDisagreementError):
            raise self.error_type(self.message)
        if self.message is not None:
            raise RuntimeError(f"zerocore: an earlier collective failed, so the ranks are out of step: {self.message}")


# The tags of hang_up's receives: no send of zerocore's has them, so none is taken.
_HANG_UP_TAGS = 1 << 30


def hang_up(group):
    """Closes this rank's connections in the gloo group `group`: every
    peer's wait on it fails at once. The ranks were found in different
    collectives (RankDisagreementError), so the engine's groups serve no
    more, and a peer may wait where no diagnosis runs (the ring
    reduce-scatter's sends and receives, whose waits are whole): its wait
    fails, and it raises the error found, which the store holds
    (Positions.found_apart), instead of waiting for the timeout or for this
    process to end. Gloo has no call for it; a receive whose wait times out
    does it (gloo's context then closes each of its connections), one a
    context (one a network device; a tag picks the context). A receive from
    a peer whose connection is closed already (it hung up first) fails
    without the timeout, so there is one from each peer: the first that
    times out closes the rest."""
    me = dist.get_rank(group)
    peers = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group)) if r != me]
    devices = len(group._get_backend(torch.device("cpu")).options._devices)
    for peer in peers:
        for tag in range(_HANG_UP_TAGS, _HANG_UP_TAGS + devices):
            try:
                dist.irecv(torch.empty(1), peer, group=group, tag=tag).wait(
                    timeout=datetime.timedelta(milliseconds=1))
            except RuntimeError:  # timed out (closed now), or closed already
                pass


def abort(group):
    """Ends this rank's collectives of the NCCL group `group` now (its CUDA
    backend's abort: ncclCommAbort), its device work stuck in them
    included; the group serves no more. An abort that fails leaves them to
    NCCL's watchdog (the timeout): the error found is raised either way."""
    try:
        group._get_backend(torch.device("cuda")).abort()
    except RuntimeError:
        pass
