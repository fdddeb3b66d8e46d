"""The single-process mixed-precision reference for 16-bit engine runs, and
the measure the tests compare with it.

mp_reference_train does in one process, with torch alone, what a mixed-
precision data-parallel step is meant to do: a 16-bit copy of the model
runs forward and backward on each rank's micro-batch on its own (the loss
multiplied by the loss scale); the 16-bit grads are summed in fp32 and
averaged over the ranks; the loss scale is divided out (torch.amp.GradScaler
for dynamic scaling: an inf/NaN grad on any rank skips the step and halves
the scale, growth_interval clean steps double it); the torch optimizer
updates the fp32 master model; the 16-bit copy is made from it. On one
thread (torch.set_num_threads(1)), as in the ranks, every micro-batch's grads
are bitwise what a rank computes from the same 16-bit params, so at world
size 1 a run of the engine is bitwise this one (SGD); elsewhere the engine
sums grads in another order (and, with a 16-bit reduce dtype, in 16 bits).

movement_error measures a run against it per param as a share of how far
the reference moved that param, which a grad that is wrong, stale or off
by a scale makes of order 1.
"""
import contextlib
import copy
import math

import torch

from models import lm_batch, lm_loss, local


@contextlib.contextmanager
def _one_thread():
    """As in the ranks: CPU LayerNorm's weight grads are summed in an order
    the thread count sets."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@_one_thread()
def mp_reference_train(model, opt, dtype, steps, accum, world, *, loss_scale=None, scaler=None, batch=lm_batch,
                       loss_fn=lm_loss, loss_factor=None, lr_scheduler=None):
    """Trains `model` (fp32, the master; `opt` over its params) on 16-bit
    copies, on one thread. loss_scale: a static scale; scaler: a
    torch.amp.GradScaler (dynamic); loss_factor(step, micro, rank):
    multiplies that rank's loss (to force an overflow); lr_scheduler steps
    after every step. Returns (the fp32 state dict, per step: (the loss
    scale it used, whether it applied))."""
    work = copy.deepcopy(model).to(dtype)
    masters = dict(model.named_parameters())
    pairs = [(masters[name], w) for name, w in work.named_parameters() if w.requires_grad]
    log = []
    for step in range(steps):
        scale = scaler.get_scale() if scaler is not None else (loss_scale or 1.0)
        sums = [torch.zeros_like(p) for p, _ in pairs]
        for micro in range(accum):
            x, y = batch(step, micro, world)
            for rank in range(world):
                loss = loss_fn(work(local(x, rank, world)), local(y, rank, world))
                if loss_factor is not None:
                    loss = loss * loss_factor(step, micro, rank)
                (scaler.scale(loss) if scaler is not None else loss * scale).backward()
                for s, (_, w) in zip(sums, pairs):
                    if w.grad is not None:
                        s += w.grad.float()
                        w.grad = None
        for s, (p, _) in zip(sums, pairs):
            p.grad = s / world
        if scaler is not None:  # unscales, skips the step on inf/NaN, halves or grows the scale
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            applied = scaler.get_scale() >= scale
        else:
            for p, _ in pairs:
                p.grad *= 1.0 / scale
            opt.step()
            applied = True
        opt.zero_grad()
        if lr_scheduler is not None:
            lr_scheduler.step()
        with torch.no_grad():
            for p, w in pairs:
                w.copy_(p)
        log.append((scale, applied))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, log


def movement_error(got, ref, initial):
    """Per param: |got - ref| / |ref - initial| (L2 norms over the tensor);
    inf where got is not finite."""
    errors = {k: float((got[k].float() - ref[k]).norm() / (ref[k] - initial[k]).norm()) for k in ref}
    return {k: e if math.isfinite(e) else math.inf for k, e in errors.items()}


def assert_moved_like(got, ref, initial, bound, what=""):
    """Every param of `got` within `bound` of the reference, as a share of
    how far the reference moved it from `initial`; returns the worst share."""
    errors = movement_error(got, ref, initial)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= bound, f"{what}: {worst} is off by {errors[worst]:.3g} of its movement (bound {bound})"
    return errors[worst]
