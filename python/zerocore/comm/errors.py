"""The errors of ranks that issued different collectives, raised on every
rank involved: CollectiveOrderError (the step's exchange found them apart,
or their micro-batch counts differ) and RankDisagreementError (a collective
waited long and its peers' positions show them in different ones:
comm/positions.py)."""
from zerocore import _native


class CollectiveOrderError(RuntimeError):
    """Ranks issued different data-plane collectives since the last step:
    raised on every rank, before params or optimizer state change."""


class RankDisagreementError(CollectiveOrderError):
    """Ranks wait in different collectives of the engine (a rank in
    full_state_dict(), another in its step): raised on every rank involved
    once a collective has waited Config(diagnose_after=...), naming each
    rank's position. The ranks are out of step: every later call of the
    engine raises it again, and the rank hangs up the engine's groups, so
    that no peer waits for it (failure.hang_up)."""


# A transport raises it on the queue's thread: Event.wait() raises it again as itself.
_native.register_rank_disagreement(RankDisagreementError)
