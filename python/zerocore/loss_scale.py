"""Loss scaling for fp16: the loss is multiplied by the scale before
backward and the gradients divided by it in the optimizer pass.

Dynamic scaling (Config.loss_scale, a DynamicLossScale) skips the step on
every rank when any rank saw an inf/NaN gradient, and halves the scale once
`hysteresis` such overflows came without a scale increase between them (1:
at every overflow, as torch.amp.GradScaler; DeepSpeed's default is 2); it
doubles the scale every `window` steps without overflow (DeepSpeed's rule,
deepspeed_growth, waits one clean step more before the first). DeepSpeed's
DynamicLossScaler is the reference (tests/test_deepspeed_config.py checks
the two step by step). An overflow at the smallest scale raises: the grads
are not finite at any scale, and skipping every step would train nothing
without a word.
"""
from __future__ import annotations


class NonFiniteGradientError(FloatingPointError):
    """Raised (on every rank) when gradients hold inf/NaN and no dynamic loss
    scaling is there to absorb it (fp32/bf16, or fp16 with the scale at its
    minimum); params and optimizer state are untouched."""


class LossScaler:
    def __init__(self, loss_scale, dtype: str):
        from zerocore.config import DynamicLossScale

        self.dynamic = isinstance(loss_scale, DynamicLossScale) and dtype == "fp16"
        self.enabled = self.dynamic or not isinstance(loss_scale, DynamicLossScale)
        self.policy = loss_scale if self.dynamic else None
        self.scale = loss_scale.initial if self.dynamic else (float(loss_scale) if self.enabled else 1.0)
        self._clean_steps = 0  # steps without overflow since the last one (or the start)
        self._hysteresis = loss_scale.hysteresis if self.dynamic else 1  # overflows left before the next halving

    def update(self, overflow: bool):
        """Records one step's outcome; with dynamic scaling, adjusts the scale."""
        if not self.dynamic:
            return
        policy = self.policy
        if overflow:
            self._clean_steps = 0
            if self._hysteresis > 1:
                self._hysteresis -= 1
                return
            if self.scale <= policy.min_scale:
                raise NonFiniteGradientError(
                    f"zerocore: fp16 gradients overflowed (inf/NaN) with the loss scale at its minimum "
                    f"({policy.min_scale:g}); they are not finite at any scale (a NaN or inf loss?), and skipping "
                    "every step would train nothing. The step was skipped on every rank.")
            self.scale = max(self.scale / 2.0, policy.min_scale)
            return
        self._clean_steps += 1
        if policy.consecutive_hysteresis:
            self._hysteresis = policy.hysteresis
        stable = self._clean_steps - (1 if policy.deepspeed_growth else 0)
        if stable > 0 and stable % policy.window == 0:
            self.scale *= 2.0
            self._hysteresis = policy.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis": self._hysteresis}

    def load_state_dict(self, state: dict):
        self.scale = state["scale"]
        self._clean_steps = state["clean_steps"]
        # Checkpoints written before hysteresis existed halved at every overflow.
        self._hysteresis = state.get("hysteresis", self.policy.hysteresis if self.policy else 1)
