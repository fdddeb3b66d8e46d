"""Config(deterministic=True): the step's gradient is the mean of every
micro-batch's grads over every rank, summed exactly, so it has the same
bits at any world size, whichever rank ran which micro-batch and in which
order (docs/deterministic.md).

After each micro-batch's backward, its grads (the flat grad buffers of
stages 0-1, which hold that micro-batch's alone) go onto one grid fixed for
the step, multiples of 2**exponent, as int64 (rounded to nearest, ties to
even), and add into int64 sums; the buffers are zeroed for the next one.
Integer sums are exact, so associative: no order of adding, on a rank or
across ranks, changes them. At the step the ranks agree on their largest
|grad| in grid units (a maximum is order-independent too) and add their
sums, chunk by chunk on the control queue. If count * (largest + 1) is
below 2**62, no partial sum in any order can have overflowed int64, and the
mean, sum * 2**exponent / count (formed in float64 from the integer sum,
then rounded into the buffers' dtype), replaces the grads; otherwise the
step is skipped on every rank, as an fp16 overflow is, and the grid widens.
Every next grid comes from the step before's largest grad and count, with
HEADROOM bits for grads to grow: the same numbers on every rank and at
every world size, so the same grid.
"""
from __future__ import annotations

import math

import torch

from zerocore.comm import ControlPurpose

HEADROOM = 8  # bits a step's largest grad (times the count) may grow over the last one's before a skip
LIMIT_BITS = 62  # count * (largest |grad| in grid units + 1) below 2**62: no int64 partial sum overflows
FIRST_BOUND = 2.0**16  # the first step's assumed largest |grad| times its count
# Every value of the dtype is a multiple of 2**this: a finer grid keeps nothing more.
_FINEST = {torch.float16: -24, torch.bfloat16: -133, torch.float32: -149}


def grid_exponent(bound: float, dtype: torch.dtype) -> int:
    """The grid for grads whose largest |grad| times the count is `bound`,
    with HEADROOM bits to spare: bound / 2**exponent < 2**(62 - HEADROOM)."""
    return max(_FINEST[dtype], math.frexp(bound)[1] + HEADROOM - LIMIT_BITS)


class ExactGradSum:
    """The exact sums of the trainable groups' grads (stages 0-1: their
    grad_full buffers), one int64 per element, on this rank."""

    def __init__(self, groups, comm):
        self.groups = [g for g in groups if g.trainable]
        self.comm = comm
        self.dtype = self.groups[0].reduce_dtype if self.groups else torch.float32
        self.exponent = grid_exponent(FIRST_BOUND, self.dtype)  # this step's grid: multiples of 2**exponent
        self.sums = [torch.zeros(g.grad_full.numel(), dtype=torch.int64, device=g.grad_full.device)
                     for g in self.groups]
        self.bytes_moved = 0  # of the ranks' sums and maxima, sent and received, since wrap
        self._reset()

    def _reset(self):
        for s in self.sums:
            s.zero_()
        self.largest = 0.0  # this rank's largest |grad| in grid units this step (inf: one was not finite)
        self.next_exponent = None  # once reduced: the next step's grid
        self.sum_of_squares = None  # once reduced: of the mean grads (inf: not finite)
        self.regrid = False  # once reduced: a grad fell outside the grid, the step is skipped

    def add_micro_batch(self):
        """After a micro-batch's backward: its grads onto the grid, into the
        sums; the grad buffers zeroed for the next one."""
        scale = 2.0**-self.exponent
        for g, total in zip(self.groups, self.sums):
            units = g.grad_full.double().mul_(scale).round_()  # a power of two: exact, then one rounding
            peak = units.abs().amax().item() if units.numel() else 0.0
            self.largest = max(self.largest, math.inf if math.isnan(peak) else peak)
            total.add_(units.to(torch.int64))  # out of range only where the step skips anyway
            g.grad_full.zero_()

    def reduce(self, count: int):
        """Once a step, after the ranks met: every rank's sums added into
        this rank's, the mean of the `count` micro-batches into the grad
        buffers, its sum of squares and whether the step is skipped."""
        rows = self.comm.gather_floats([self.largest], ControlPurpose.EXACT_GRADS)
        self.bytes_moved += 8 * 2 * len(rows)
        largest = max(row[0] for row in rows)
        if not math.isfinite(largest):  # the step decides as for any non-finite grad
            self.sum_of_squares, self.next_exponent = math.inf, self.exponent
            return
        self.next_exponent = grid_exponent(count * largest * 2.0**self.exponent, self.dtype)
        if count * (int(largest) + 1) >= 2**LIMIT_BITS:
            self.regrid, self.sum_of_squares = True, 0.0
            return
        for total in self.sums:
            self.bytes_moved += self.comm.sum_int64(total, ControlPurpose.EXACT_GRADS)
        squares = 0.0
        for g, total in zip(self.groups, self.sums):
            g.grad_full.copy_(total.double().mul_(2.0**self.exponent).div_(count))
            # Per param, in plan order: its view has the same shape at every
            # world size (the flat buffer's padding does not).
            for i in range(len(g.params)):
                squares += g.grad_view(i).double().square().sum().item()
        self.sum_of_squares = squares

    def end_step(self):
        """The step ended (applied, skipped, or its grads dropped): the next
        one starts from zero on the grid this one chose."""
        if self.next_exponent is not None:
            self.exponent = self.next_exponent
        for g in self.groups:
            g.grad_full.zero_()
        self._reset()

    def state_dict(self) -> dict:
        return {"exponent": self.exponent}

    def load_state_dict(self, state: dict):
        self.exponent = int(state["exponent"])
