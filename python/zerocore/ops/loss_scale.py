"""Loss scaling for fp16: the loss is multiplied by the scale before
backward and the native step divides it out of the grads.

The bookkeeping (a fixed scale, or dynamic scaling: skip the step on every
rank when any rank saw an inf/NaN gradient, halve the scale after
`hysteresis` overflows, double it after `window` clean steps, raise at the
minimum scale) is the native LossScaler the step holds
(cpp/include/zerocore/step/loss_scaler.h), so C++ embedders get the same;
DeepSpeed's DynamicLossScaler is its reference (tests/test_deepspeed_config.py
checks the two step by step). This is its Python face: built from the
Config, its state in checkpoints.
"""
from __future__ import annotations

from zerocore import _native

# Raised (on every rank) when gradients hold inf/NaN and no dynamic loss
# scaling is there to absorb it (fp32/bf16, or fp16 with the scale at its
# minimum); params and optimizer state are untouched.
NonFiniteGradientError = _native.NonFiniteGradientError


class LossScaler:
    def __init__(self, loss_scale, dtype: str):
        from zerocore.config import DynamicLossScale

        dynamic = isinstance(loss_scale, DynamicLossScale) and dtype == "fp16"
        # A DynamicLossScale outside fp16 (the default) scales nothing.
        self.enabled = dynamic or not isinstance(loss_scale, DynamicLossScale)
        # What a checkpoint written before hysteresis existed starts from (it halved at every overflow).
        self._hysteresis = loss_scale.hysteresis if dynamic else 1
        if dynamic:
            p = loss_scale
            self.native = _native.LossScaler.dynamic_scale(p.initial, p.window, p.hysteresis, p.min_scale,
                                                           p.consecutive_hysteresis, p.deepspeed_growth)
        else:
            self.native = _native.LossScaler(float(loss_scale) if self.enabled else 1.0)

    @property
    def dynamic(self) -> bool:
        return self.native.dynamic

    @property
    def scale(self) -> float:
        return self.native.scale

    def update(self, overflow: bool):
        """Records one step's outcome (the native step does, each step)."""
        self.native.update(overflow)

    def state_dict(self) -> dict:
        scale, clean_steps, hysteresis = self.native.state()
        return {"scale": scale, "clean_steps": clean_steps, "hysteresis": hysteresis}

    def load_state_dict(self, state: dict):
        self.native.load(state["scale"], state["clean_steps"], state.get("hysteresis", self._hysteresis))
