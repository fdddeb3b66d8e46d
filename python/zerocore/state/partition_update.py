"""Where a rank's step updates its partition, behind one interface the
engine calls: InPlaceUpdate (the partition lives where training runs: the
native step updates its runs) and offload.OffloadUpdate (ZeRO-Offload: on
the host, through the HostUpdate the native step drives).

    use(core)                            the EngineCore (_native) whose step
                                         updates the partition
    count_grads(backward_calls)          the step's exchange is about to take
                                         the grads (offload counts the bytes)
    follow_swaps()                       after a native step call: views of
                                         buffers the step swapped follow
    params_up() -> bool                  finishes a pending (delayed) update and
                                         copies its params up; True if there
                                         was one (stages 1-3 then gather them)
    stats()                              what comm_stats() reports of it
"""
from __future__ import annotations


class InPlaceUpdate:
    """The partition's runs, which the native step updates in the same call
    as it decides the step (the EngineCore takes them from the stores)."""

    def use(self, core):
        pass

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
