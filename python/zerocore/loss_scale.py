"""Loss scaling for fp16: the loss is multiplied by the scale before
backward and the gradients divided by it in the optimizer pass.

Dynamic scaling halves the scale when any rank saw an inf/NaN gradient (the
step is then skipped on every rank) and doubles it after `growth_interval`
clean steps, as torch.amp.GradScaler does.
"""
from __future__ import annotations


class LossScaler:
    def __init__(self, loss_scale, dtype: str, init_scale=2.0**16, growth_interval=2000):
        self.dynamic = loss_scale == "dynamic" and dtype == "fp16"
        self.enabled = self.dynamic or loss_scale != "dynamic"
        self.scale = init_scale if self.dynamic else (float(loss_scale) if self.enabled else 1.0)
        self.growth_interval = growth_interval
        self._clean_steps = 0

    def update(self, overflow: bool):
        """Records one step's outcome; with dynamic scaling, adjusts the scale."""
        if not self.dynamic:
            return
        if overflow:
            self.scale = max(self.scale / 2.0, 1.0)
            self._clean_steps = 0
        else:
            self._clean_steps += 1
            if self._clean_steps >= self.growth_interval:
                self.scale *= 2.0
                self._clean_steps = 0
