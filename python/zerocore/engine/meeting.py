"""The ranks' meetings in a step: before each forward and backward that
issues collectives, and at the step's exchange, every rank says where it
is (one small control collective), so that ranks that ran different
numbers of micro-batches raise, every one, instead of waiting in
collectives their peers never issue.
"""
from __future__ import annotations

from zerocore.comm.communicator import MICRO_BATCHES, CollectiveOrderError

# Where a rank is in its step: before a micro-batch's forward or backward, or at the step.
PLACES = ("forward", "backward", "step")


def meet(comm, place: str, progress):
    """Every rank at the same place `place` of its step (PLACES; progress:
    the TrainingLoop's StepProgress), or every rank raises
    CollectiveOrderError naming each one's: a rank that runs
    more micro-batches than another would otherwise wait, until the
    timeout, in a collective its peers never issue (stage 3's rounds,
    stage 2's reduce-scatters, a buffer broadcast) while they wait in the
    step's. The ranks meet before each forward and backward that issues
    collectives and at the step's exchange (one small control collective
    each), so the first place where they part is a meeting. At stage 3
    the forward meets (its rounds are a micro-batch's first
    collectives), not the backward, which begins by answering the rounds
    of peers still in their forward: a rank must not wait in a meeting
    while a peer may wait for its answers (UnitScheduler.joining), so a
    forward right after a forward with no backward (evaluation) does not
    meet, and the step closes stage 3's passes before meeting."""
    if comm.world_size == 1:
        return
    # The micro-batch about to run; at the step, how many ran.
    micro_batch = progress.backward_calls + (place != "step")
    # At the step, the forwards with grad too: one that raised on a rank whose loop skipped its batch, or
    # whose backward never ran, leaves that rank a forward ahead, which pairing steps would hide.
    forwards = progress.grad_forwards if place == "step" else 0
    mine = (len(PLACES) * micro_batch + PLACES.index(place)) << 32 | forwards
    # A host number: the meeting waits for no device work (on CUDA the host runs on ahead of the GPU).
    places = [(*divmod(v >> 32, len(PLACES)), v & 0xFFFFFFFF)
              for v in comm.gather_ints(mine, MICRO_BATCHES, after_compute=False)]
    if len(set(places)) == 1:
        return

    def at(n, p, f):
        if PLACES[p] != "step":
            return f"at the {PLACES[p]} of micro-batch {n}"
        return (f"at the step after {n} micro-batch(es) (engine.backward calls) and {f} forward(s) with grad"
                + (f" ({f - n} raised, or had no engine.backward)" if f > n else ""))
    ranks = "\n".join(f"  rank {r}: {at(*place)}" for r, place in enumerate(places))
    raise CollectiveOrderError(
        f"zerocore: the ranks ran different numbers of micro-batches in this step:\n{ranks}\nEvery rank must "
        "run as many forwards and engine.backward calls between steps as every other: give each rank as many "
        "batches (DistributedSampler(drop_last=True), or stop every rank at the count of the one with "
        "fewest), and where a forward, a backward or your code between them raises on one rank and your loop "
        "skips the batch, call engine.zero_grad() on that rank before the next batch and on every rank after "
        "this error. Nothing was updated; engine.zero_grad() on every rank drops this step's grads, and "
        "training can go on.")
