"""zerocore.Adam, AdamW and SGD: torch optimizers whose updates are the
SIMD kernels of zerocore.ops, on ordinary fp32 CPU params. zerocore.wrap
takes them as it takes torch's own (engine/optimizer_bridge.py).
"""
from __future__ import annotations

import torch

from zerocore import ops


class NativeOptimizer(torch.optim.Optimizer):
    """Base of zerocore's standalone optimizers: per-param native updates."""

    kind = ""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous():
                    raise TypeError(f"zerocore.{type(self).__name__} updates contiguous float32 CPU params; "
                                    f"got {p.dtype} on {p.device} (wrap the model with zerocore.wrap for "
                                    "16-bit or partitioned training)")
                self._update(group, p, self.state[p])
        return loss


class Adam(NativeOptimizer):
    kind = "adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _update(self, group, p, state):
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        ops.adam_(p.view(-1), p.grad.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
                  step=state["step"], lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                  eps=group["eps"], weight_decay=group["weight_decay"], adamw=self.kind == "adamw")


class AdamW(Adam):
    kind = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


class SGD(NativeOptimizer):
    kind = "sgd"

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov))

    def _update(self, group, p, state):
        state["step"] = state.get("step", 0) + 1
        buf = None
        if group["momentum"]:
            buf = state.setdefault("momentum_buffer", torch.zeros_like(p)).view(-1)
        ops.sgd_(p.view(-1), p.grad.view(-1), buf, step=state["step"], lr=group["lr"],
                 momentum=group["momentum"], dampening=group["dampening"], weight_decay=group["weight_decay"],
                 nesterov=group["nesterov"])
