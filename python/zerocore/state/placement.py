"""ZeRO stages as placement policies: what each stage partitions across
ranks, hence where each model state lives and how gradients are reduced.
The engine, flat groups and reducers ask these questions and never compare
stage numbers, so a stage is defined here and nowhere else.

    stage  optimizer states  gradients                      parameters
    0      replicated        all-reduced at the step        replicated
    1      partitioned       reduce-scattered at the step   all-gathered after the step
    2      partitioned       reduce-scattered in backward   all-gathered after the step
    3      partitioned       reduce-scattered in backward   shards, gathered per unit

Offload (ZeRO-Offload, stages 1-3) moves states to the host: the fp32
master, the optimizer states and the grads the host step reads
(optimizer_on_host), and, in stage 3, the param shards (params_on_host).
The device keeps the params training reads, and gradient reduction's and
the gathers' buffers.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Placement:
    stage: int
    optimizer_on_host: bool = False
    params_on_host: bool = False

    @classmethod
    def of(cls, config) -> "Placement":
        return cls(config.stage, config.offload_optimizer == "cpu", config.offload_params == "cpu")

    @property
    def partitions_optimizer(self) -> bool:
        """Each rank updates only its partition (stages 1-3); stage 0 runs
        the same whole update on every rank."""
        return self.stage >= 1

    @property
    def partitions_grads(self) -> bool:
        """Grads are reduce-scattered bucket by bucket during backward and
        only the rank's partition is kept (stages 2-3); otherwise full grads
        accumulate and are reduced once at the step."""
        return self.stage >= 2

    @property
    def partitions_params(self) -> bool:
        """Params live as shards and are gathered per unit (stage 3)."""
        return self.stage == 3
