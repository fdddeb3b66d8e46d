"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR,
WarmupCosineLR) as torch LR schedulers, for the `scheduler` block of a
DeepSpeed config (integrations/deepspeed/config.py).

DeepSpeed counts batches from -1: its scheduler sets iteration -1's rate at
construction and each step() moves one iteration on, so the first two steps
both run at the warmup's starting rate. A torch scheduler's last_epoch is 0
after construction, so iteration = last_epoch - 1 here. The formulas are
DeepSpeed's (deepspeed/runtime/lr_schedules.py); tests compare the two
step by step.
"""
from __future__ import annotations

import math

from torch.optim.lr_scheduler import LRScheduler

_WARMUP_TYPES = ("log", "linear")


def _per_group(optimizer, value, what):
    """A value for each param group: `value` itself when it is a list."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"DeepSpeed scheduler: {what} has {len(value)} values for "
                             f"{len(optimizer.param_groups)} param groups")
        return list(value)
    return [value] * len(optimizer.param_groups)


class _Warmup(LRScheduler):
    """The warmup DeepSpeed's three schedules share: from the start to the
    peak over warmup_num_steps (at least 2), on a log or linear curve."""

    def __init__(self, optimizer, warmup_num_steps, warmup_type):
        if not isinstance(warmup_num_steps, int) or isinstance(warmup_num_steps, bool) or warmup_num_steps <= 0:
            raise ValueError(f"DeepSpeed scheduler: warmup_num_steps={warmup_num_steps!r}; use a positive integer")
        if warmup_type not in _WARMUP_TYPES:
            raise ValueError(f"DeepSpeed scheduler: warmup_type={warmup_type!r}; use one of {_WARMUP_TYPES}")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer)

    @property
    def iteration(self) -> int:
        return self.last_epoch - 1

    def warmup_fraction(self) -> float:
        """How far the warmup has come at this iteration (0 to 1)."""
        it = self.iteration
        if self.warmup_type == "log":
            return math.log(it + 1) / math.log(self.warmup_num_steps)
        return it / self.warmup_num_steps


class WarmupLR(_Warmup):
    """DeepSpeed's WarmupLR: from warmup_min_lr to warmup_max_lr (default:
    each group's lr), then constant."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type="log"):
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        super().__init__(optimizer, warmup_num_steps, warmup_type)

    def gamma(self) -> float:
        return self.warmup_fraction() if self.iteration < self.warmup_num_steps else 1.0

    def get_lr(self):
        if self.iteration < 0:
            return list(self.min_lrs)
        g = self.gamma()
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's WarmupDecayLR: WarmupLR's warmup (warmup_max_lr defaults
    to 0.001 here, as in DeepSpeed), then linear decay to 0 at
    total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type="log"):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def gamma(self) -> float:
        if self.iteration < self.warmup_num_steps:
            return self.warmup_fraction()
        return max(0.0, (self.total_num_steps - self.iteration) /
                   max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Warmup):
    """DeepSpeed's WarmupCosineLR: rates are ratios of each group's lr,
    from warmup_min_ratio up to 1, then a cosine down to cos_min_ratio at
    total_num_steps, staying there."""

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type="log"):
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        super().__init__(optimizer, warmup_num_steps, warmup_type)

    def ratio(self) -> float:
        if self.iteration < self.warmup_num_steps:
            return self.warmup_min_ratio + self.warmup_fraction() * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (self.iteration - self.warmup_num_steps + 1) /
                       max(1, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def get_lr(self):
        if self.iteration < 0:
            return [0.0 for _ in self.base_lrs]
        r = self.ratio()
        return [lr * r for lr in self.base_lrs]


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}
