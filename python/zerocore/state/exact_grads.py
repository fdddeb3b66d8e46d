"""Config(deterministic=True): the step's gradient is the mean of every
micro-batch's grads over every rank, summed exactly, so it has the same
bits at any world size, whichever rank ran which micro-batch and in which
order (docs/deterministic.md).

Each micro-batch's grads go onto a grid fixed for the step, each param's
own, multiples of 2**exponent (rounded to nearest, ties to even), and add
into integer sums. Integer sums are exact, so associative: no order of adding, on
a rank or across ranks, changes them. Stages 0-1: the flat grad buffers
hold one micro-batch's grads after its backward; they are added into
whole-size sums here and zeroed, and at the step the engine all-reduces
(stage 0) or reduce-scatters (stage 1) the sums as int64 where it would
have reduced the grads (grad_reducer.FullGradReducer's collectives), before
the step's exchange, whose copies to the host (offload) then take the
mean. Stages 2-3: gradient reduction (the native BucketReducer, in int64)
stages each param's grad onto its grid (grid_for's exponent: one native
pass into the int64 staging, no copy), reduce-scatters its
buckets as integers and adds each rank's block into the partition's sums,
which (grads on the device) live in the grad partition's own memory, 5
bytes an element (FlatGroup.buffers["grad_sums"]: 40-bit integers, packed, as n x 5
torch bytes), the mean formed in its first bytes.

The kernels that put a grad on its grid also keep each param's largest
|grad| (a float32 a param, where the grads are: no host wait a grad), read
once at the step. Then the ranks agree on their largest |grad| of each
param in its grid's units (a maximum is order-independent too) and, where each holds a part
of the grads, on their parts of the norm. If count * (largest + 1) is
below 2**39 for every param, no partial sum in any order can have left
the 40 bits a partition keeps, and the mean,
sum * 2**exponent / count (formed in float64 from the integer sum, then
rounded into the grad buffers' dtype), becomes the grads the update reads;
otherwise the step is skipped on every rank, as an fp16 overflow is, and
the grids widen. The norm is the exact mean's: the squares of the integer
sums, added exactly (in 128-bit integers, scaled to the finest grid) and
across ranks as integers. Every param's next grid comes from its largest
grad in the step before and the count, with HEADROOM bits for grads to
grow: the same numbers on every rank and at every world size, so the same
grids.
"""
from __future__ import annotations

import math
import struct
from fractions import Fraction

import torch

from zerocore import _native
from zerocore.comm.communicator import ControlPurpose

HEADROOM = 8  # bits a step's largest grad (times the count) may grow over the last one's before a skip
# count * (largest |grad| in grid units + 1) below 2**39: no partial sum, in
# any order, leaves the int40 a grad partition keeps (nor the int64 of the
# staging, the reductions and stages 0-1's sums).
LIMIT_BITS = 39
FIRST_BOUND = 2.0**8  # the first step's assumed largest |grad| times its count (2**16 fits, HEADROOM)
# Every value of the dtype is a multiple of 2**this: a finer grid keeps nothing more.
_FINEST = {torch.float16: -24, torch.bfloat16: -133, torch.float32: -149}
_WORDS = 8  # 32-bit words of a rank's exact sum of squares in the exchange (below 2**256)
_MEAN_CHUNK = 1 << 18  # elements of the mean formed at a time (int64 and float64 temporaries of 2 MiB)
_INT40_SHIFTS = tuple(8 * b for b in range(5))  # an int40's bytes, least significant first


def grid_exponent(bound: float, dtype: torch.dtype) -> int:
    """The grid for grads whose largest |grad| times the count is `bound`,
    with HEADROOM bits to spare: bound / 2**exponent < 2**(LIMIT_BITS - HEADROOM)."""
    return max(_FINEST[dtype], math.frexp(bound)[1] + HEADROOM - LIMIT_BITS)


def planned_bytes(groups, placement) -> int:
    """Device bytes the exact sums of these groups take beyond the grad
    buffers their buffer_plan() lists (before anything is allocated: what
    zerocore.estimate adds, what memory_report() then counts): where the
    grad partition holds them, its fifth byte an element (int40 in place of
    a 4-byte grad; 3 more for a 2-byte one); elsewhere int64 sums of their
    own, one per element of the grads the update reads."""
    extra = 0
    for g in groups:
        for name, _, _, n, dtype in g.buffer_plan() if g.trainable else ():
            if name == ("grad_part" if placement.partitions_grads else "grad_full"):
                extra += n * (5 - dtype.itemsize) if g.store.has("grad_sums") else 8 * n
    return extra


def sums_of_squares(sums: torch.Tensor, runs) -> list:
    """Per run (first, length) of `sums` (int64, or int40 as n x 5 bytes),
    the exact sum of its squares as a Python int: one native pass on the
    host, in 128-bit integers (kernels/cpu_exact_grid.h); a GPU's sums are
    copied there first, once a step."""
    words = _native.exact_sums_of_squares(sums.cpu(), [(first, length, None) for first, length in runs])
    return [low + (high << 64) + (top << 128) for low, high, top in words]


def as_int64(sums: torch.Tensor) -> torch.Tensor:
    """`sums` as int64: themselves, or int40 sums (n x 5 bytes, little-endian
    two's complement) widened, in torch's ops (on any device)."""
    if sums.dtype == torch.int64:
        return sums
    wide = sums.to(torch.int64)
    value = (wide << torch.tensor(_INT40_SHIFTS, device=sums.device)).sum(1)
    return value - ((wide[:, 4] >> 7) << 40)  # the top bit set: negative


def add_on_grid_with_torch(sums: torch.Tensor, grad: torch.Tensor, exponent: int, largest: torch.Tensor):
    """The native accumulate_on_grid in torch's ops (on any device, a GPU's
    stages 0-1): sums (int64) += grad on the grid of 2**exponent (the
    scaling by a power of two is exact in float64, then round_ rounds once,
    ties to even), and largest (one float32) the largest of itself and every
    |grad| (a NaN or an inf stays: not finite), with no host wait."""
    sums.add_(grad.double().mul_(2.0**-exponent).round_().to(torch.int64))
    if grad.numel():
        torch.maximum(largest, grad.detach().abs().max().float(), out=largest)


def in_grid_units(top: float, exponent: int) -> float:
    """A largest |grad| on the grid of 2**exponent, rounded as the grads
    are (ties to even; rounding is monotonic, so it is their largest); inf
    where it is not finite (the step is skipped). A float32 on the finest
    grid, 2**-149, stays below 2**277: no overflow."""
    return float(round(math.ldexp(top, -exponent))) if math.isfinite(top) else math.inf


def _grid_runs(runs, exponents) -> list:
    """A stretch's runs (first, length, param or None) as the native step
    takes them: (first, length, the param's exponent or None: padding)."""
    return [(first, length, None if param is None else exponents[param]) for first, length, param in runs]


class ExactGradSum:
    """The exact sums of the trainable groups' grads on this rank, one
    integer per element: whole (stages 0-1, int64, in the grad_full layout)
    or the rank's partition (stages 2-3: int40 in the grad partition's
    memory on the device, int64 beside an offloaded one). Each param has a
    grid of its own, multiples of 2**exponents[group][param]."""

    def __init__(self, groups, comm, placement):
        self.groups = [g for g in groups if g.trainable]
        self.comm = comm
        self.partitioned = placement.partitions_grads  # the sums are the partition's
        self.shared = placement.partitions_optimizer  # each rank holds a part of the mean: the norm is summed
        self.dtype = self.groups[0].dtype if self.groups else torch.float32
        first = grid_exponent(FIRST_BOUND, self.dtype)
        self.exponents = [[first] * len(g.params) for g in self.groups]  # this step's grids, per param
        # Stages 2-3 on the device: the grad partition's own memory holds
        # them (FlatGroup.buffers["grad_sums"]), the mean formed in its first bytes.
        self.sums = [g.buffers["grad_sums"] if self.partitioned and "grad_sums" in g.buffers else
                     torch.zeros(self._grads(g).numel(), dtype=torch.int64, device=self._grads(g).device)
                     for g in self.groups]
        # Bytes of sums beside the groups' buffers (memory_report counts the rest as grad_part's).
        self.own_bytes = sum(s.nbytes for s, g in zip(self.sums, self.groups) if s is not g.buffers.get("grad_sums"))
        self._index = {id(g): i for i, g in enumerate(self.groups)}
        # Per group, each param's largest |grad| this step (float32, where its
        # grads are: kept by the kernels that put them on the grid, read once
        # at the step), made at the first grad.
        self._tops = [None] * len(self.groups)
        self._runs = [self._runs_of(g) for g in self.groups]
        self.bytes_moved = 0  # of the agreements (control plane), received, since wrap
        self._reset()

    def _grads(self, group) -> torch.Tensor:
        """The buffer the update reads the group's grads from."""
        return group.buffers["grad_part" if self.partitioned else "grad_full"]

    def sums_of(self, group) -> torch.Tensor:
        return self.sums[self._index[id(group)]]

    def _runs_of(self, group) -> list:
        """This rank's stretches of the group's sums and grads, in order:
        its partition, or at stages 0-1 its block of every bucket (all of
        it at stage 0); each a list of (first, elements, param index or
        None for padding) covering it whole."""
        whole = "grad_full" in group.buffers and not self.partitioned
        if whole:
            n = group.buffers["grad_full"].numel()
            spans = [(*group.store.param_span(n, j), j) for j in range(len(group.params))]
            windows = [group.store.shard_span(n, b, group.rank) for b in range(len(group.buckets))]
        else:
            n = self._grads(group).numel()
            spans = [(*group.store.segment_span(n, i), seg.param) for i, seg in enumerate(group.segments)]
            windows = [(0, n)]
        out = []
        for lo, size in windows:
            runs, at = [], lo
            for first, length, j in sorted(spans):
                start, end = max(first, lo), min(first + length, lo + size)
                if start < end:
                    if start > at:
                        runs.append((at - lo, start - at, None))
                    runs.append((start - lo, end - start, j))
                    at = end
            if at < lo + size:
                runs.append((at - lo, lo + size - at, None))
            out.append((lo, size, runs))
        return out

    def _mine(self):
        """(sums, grads, exponents, runs) of each stretch of this rank's
        (_runs_of)."""
        for g, s, exponents, stretches in zip(self.groups, self.sums, self.exponents, self._runs):
            grads = self._grads(g)
            for lo, size, runs in stretches:
                yield s[lo:lo + size], grads[lo:lo + size], exponents, runs

    def _reset(self):
        for s in self.sums:
            s.zero_()
        for tops in self._tops:
            if tops is not None:
                tops.zero_()
        self.next_exponents = None  # once reduced: the next step's grids
        self.squares = None  # once reduced: the exact mean's sum of squares (inf: not finite)
        self.regrid = False  # once reduced: a grad fell outside its grid, the step is skipped

    def _top(self, i: int, param: int, device) -> torch.Tensor:
        """Where param `param` of group `i` keeps its largest |grad|."""
        if self._tops[i] is None:
            self._tops[i] = torch.zeros(len(self.groups[i].params), dtype=torch.float32, device=device)
        return self._tops[i][param:param + 1]

    def _largest(self) -> list:
        """This rank's largest |grad| this step in grid units, per group and
        param (inf: one was not finite): each group's read once."""
        out = []
        for i, g in enumerate(self.groups):
            tops = self._tops[i].tolist() if self._tops[i] is not None else [0.0] * len(g.params)
            out.append([in_grid_units(top, e) for top, e in zip(tops, self.exponents[i])])
        return out

    def _add_on_grid(self, sums: torch.Tensor, grad: torch.Tensor, group, param: int):
        """Stages 0-1: sums (int64) += param `param` of `group`'s grad on its
        grid this step (rounded to nearest, ties to even: on the host one
        native pass with no temporary), its largest kept."""
        i = self._index[id(group)]
        exponent, top = self.exponents[i][param], self._top(i, param, grad.device)
        if grad.device.type == "cpu":
            _native.accumulate_on_grid(sums, grad, exponent, top)
        else:  # the native pass is the host's: torch's ops on a GPU
            add_on_grid_with_torch(sums, grad, exponent, top)

    def grid_for(self, grad: torch.Tensor, group, param: int) -> tuple:
        """Stages 2-3: (the exponent of the grid param `param` of `group`'s
        grad goes onto as the native reducer stages it, where the kernel
        keeps its largest |value|): one pass, no int64 copy, no host wait
        (Backend::accumulate_on_grid)."""
        i = self._index[id(group)]
        return self.exponents[i][param], self._top(i, param, grad.device)

    def add_micro_batch(self):
        """Stages 0-1, after a micro-batch's backward: its grads into the
        sums, the grad buffers zeroed for the next one."""
        if self.partitioned:
            return
        for g, total in zip(self.groups, self.sums):
            for j in range(len(g.params)):
                self._add_on_grid(g.view(total, "param", j), g.view(g.buffers["grad_full"], "param", j), g, j)
            g.buffers["grad_full"].zero_()

    def reduce(self, count: int, reducer=None):
        """Once a step, after the ranks met and the sums were reduced: the
        mean of the `count` micro-batches into the grad buffers, its sum of
        squares and whether the step is skipped. reducer: stages 2-3's
        native BucketReducer, whose late grads (staged after their bucket
        was reduced: reentrant checkpointing) the ranks agree on here and
        reduce into the sums first, before any rank reads them."""
        late = list(reducer.late()) if reducer is not None else []
        largest, totals, late = self._agree(late)
        if any(late):  # on some rank: every rank reduces those buckets, and the sums changed
            reducer.reduce_late(late)
            largest, totals, _ = self._agree([])
        flat = [x for per_group in largest for x in per_group]
        if not all(math.isfinite(x) for x in flat):  # the step decides as for any non-finite grad
            self.squares, self.next_exponents = math.inf, self.exponents
            return
        # A param with no grad keeps its grid: a zero says nothing of its next grads.
        self.next_exponents = [[grid_exponent(count * x * 2.0**e, self.dtype) if x else e
                                for x, e in zip(per_group, exponents)]
                               for per_group, exponents in zip(largest, self.exponents)]
        if any(count * (int(x) + 1) >= 2**LIMIT_BITS for x in flat):
            self.regrid, self.squares = True, 0.0
            return
        for sums, grads, exponents, runs in self._mine():
            self._mean_into(sums, grads, exponents, runs, count)
        # (sum * 2**e / count)**2, summed: exact as a fraction, rounded once.
        self.squares = math.ldexp(float(Fraction(sum(totals), count * count)), 2 * self._finest())

    def _finest(self) -> int:
        """The finest grid of any param: the unit of the exact sums of squares."""
        return min((e for exponents in self.exponents for e in exponents), default=0)

    def _mean_into(self, sums, grads, exponents, runs, count: int):
        """grads = sums * 2**exponent / count (formed in float64, rounded
        into the grads' dtype), run by run, in order (padding: zeros): on the
        host one native pass over the stretch (kernels/cpu_exact_grid.h),
        on a GPU a chunk at a time in torch's ops, the same numbers. Where
        grads lie in the sums' own first bytes (FlatGroup.buffers["grad_sums"]),
        each write lands on sums read already."""
        if sums.device.type == "cpu":
            _native.mean_of_sums(sums, grads, _grid_runs(runs, exponents), count)
            return
        for first, length, param in runs:
            if param is None:
                grads[first:first + length].zero_()
                continue
            scale = 2.0**exponents[param]
            for at in range(first, first + length, _MEAN_CHUNK):
                part = slice(at, min(at + _MEAN_CHUNK, first + length))
                grads[part].copy_(as_int64(sums[part]).double().mul_(scale).div_(count))

    def _sum_of_squares(self) -> int:
        """This rank's exact sum of squares of its sums, in units of the
        finest grid squared (each param's scaled up to it): one native pass
        a stretch, on the host (a GPU's sums are copied there, a stretch at
        a time)."""
        finest, total = self._finest(), 0
        for sums, _, exponents, runs in self._mine():
            params = [(first, length, param) for first, length, param in runs if param is not None]
            for square, (_, _, param) in zip(sums_of_squares(sums, [run[:2] for run in params]), params):
                total += square << 2 * (exponents[param] - finest)
        return total

    def _norm_words(self) -> int:
        """32-bit words of a rank's sum of squares in the agreement, from
        numbers every rank has: its elements (below 2**40 each, in grid
        units) times the widest scaling up to the finest grid."""
        elements = sum(s.shape[0] for s in self.sums) if self.partitioned else \
            sum(g.buffers["grad_full"].numel() for g in self.groups)
        spread = max((e for exponents in self.exponents for e in exponents), default=0) - self._finest()
        return (elements.bit_length() + 2 * (LIMIT_BITS + 1 + spread)) // 32 + 1

    def _agree(self, late: list) -> tuple:
        """One control all-gather: (the ranks' largest |grad| in grid units,
        per group and param, their exact sums of squares of their stretches
        (this rank's alone where each rank holds all of them), the buckets
        late on any rank), every number in 32-bit words of int64 rows."""
        total = self._sum_of_squares()
        mine = [x for per_group in self._largest() for x in per_group]
        late_words = [sum(1 << b for b, flag in enumerate(late[w:w + 32]) if flag) for w in range(0, len(late), 32)]
        words = self._norm_words() if self.shared else 0
        norm_words = [(total >> (32 * w)) & 0xFFFFFFFF for w in range(words)]
        rows = self.comm.gather_int_rows([struct.unpack("<q", struct.pack("<d", x))[0] for x in mine] + late_words
                                         + norm_words, ControlPurpose.EXACT_GRADS)
        self.bytes_moved += 8 * len(rows) * len(rows[0])
        flat = [max(struct.unpack("<d", struct.pack("<q", row[k]))[0] for row in rows) for k in range(len(mine))]
        largest, at = [], 0
        for g in self.groups:
            largest.append(flat[at:at + len(g.params)])
            at += len(g.params)
        agreed = 0
        for row in rows:
            agreed |= sum(w << (32 * i) for i, w in enumerate(row[len(mine):len(mine) + len(late_words)]))
        totals = [sum(w << (32 * i) for i, w in enumerate(row[len(mine) + len(late_words):])) for row in rows] \
            if self.shared else [total]
        return largest, totals, [bool(agreed >> b & 1) for b in range(len(late))]

    def end_step(self):
        """The step ended (applied, skipped, or its grads dropped): the next
        one starts from zero on the grids this one chose."""
        if self.next_exponents is not None:
            self.exponents = self.next_exponents
        if not self.partitioned:
            for g in self.groups:
                g.buffers["grad_full"].zero_()
        self._reset()

    def state_dict(self) -> dict:
        return {"exponents": self.exponents}

    def load_state_dict(self, state: dict):
        if "exponent" in state:  # saved before the grids were per param: one grid for all
            state = {"exponents": [[state["exponent"]] * len(e) for e in self.exponents]}
        if [len(e) for e in state["exponents"]] != [len(e) for e in self.exponents]:
            raise ValueError(f"the checkpoint's grids are for {[len(e) for e in state['exponents']]} params a "
                             f"group, this model's groups hold {[len(e) for e in self.exponents]}")
        self.exponents = [[int(e) for e in per_group] for per_group in state["exponents"]]
