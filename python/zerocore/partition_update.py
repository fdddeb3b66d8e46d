"""Where a rank's step updates its partition, behind one interface the
engine calls: InPlaceUpdate (the partition lives where training runs: the
native step updates its runs) and offload.OffloadUpdate (ZeRO-Offload: on
the host, through the HostUpdate the native step drives).

    count_grads(backward_calls)          the step's exchange is about to take
                                         the grads (offload counts the bytes)
    follow_swaps()                       after a native step call: views of
                                         buffers the step swapped follow
    params_up() -> bool                  finishes a pending (delayed) update and
                                         copies its params up; True if there
                                         was one (stages 1-2 then gather them)
    stats()                              what comm_stats() reports of it
"""
from __future__ import annotations

from zerocore import ops


class InPlaceUpdate:
    """The partition's runs, which the native step (_native.ZeroStep)
    updates in the same call as it decides the step."""

    def __init__(self, groups):
        views = [v for g in groups if g.trainable for v in g.run_views()]
        self.runs = ops.FlatRuns(*([list(column) for column in zip(*views)] if views else [[]] * 6))

    def count_grads(self, backward_calls: int):
        pass

    def follow_swaps(self):
        pass

    def params_up(self) -> bool:
        return False

    def stats(self) -> dict:
        return {}

    def reset_stats(self):
        pass
