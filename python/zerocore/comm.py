"""Collectives over a torch.distributed process group, counted by kind.

Data-plane collectives (the ones whose volume the ZeRO formulas predict)
are counted in elements at their full, unpartitioned size: an all-gather
by its output, a reduce-scatter by its input, an all-reduce by its tensor.
Control-plane traffic (layout checks, overflow flags, norms, buffer
broadcasts, checkpoint gathers) is not counted.

Without a process group (stage 0 on one process) every collective is the
identity, still counted, so the accounting reads the same.

The order contract: every data-plane collective names what it moves (a key:
the flat group's tag, the same on every rank, and the bucket), folded into a
running fingerprint (and, for messages, kept in a trace of bounded length).
Once a step, sum_checking_order exchanges the fingerprint in the step's one
control collective, so ranks that issued
different collectives (another unit, bucket or size, or another order)
raise CollectiveOrderError on every rank before anything is updated, at no
extra collective per call. Only on that error path do ranks exchange their
traces, to name the first collective where they parted.
"""
from __future__ import annotations

import hashlib
from collections import Counter

import torch
import torch.distributed as dist

KINDS = ("all_gather", "reduce_scatter", "all_reduce")

# torch 2.13 renamed the tensor collectives; keep working with older names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveOrderError(RuntimeError):
    """Ranks issued different data-plane collectives since the last step:
    raised on every rank, before params or optimizer state change."""


class _Done:
    """The handle of a collective that finished synchronously."""

    def wait(self):
        return True


class Communicator:
    # Collectives remembered between checks, for naming where ranks parted
    # (the fingerprint covers all of them): an engine used for inference
    # only, never stepping, must not grow without bound.
    TRACE_LIMIT = 100_000

    def __init__(self, group):
        self.group = group
        self.distributed = group is not None
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.stats = Counter({k: 0 for k in KINDS})
        self._start_trace()

    def reset_stats(self):
        self.stats = Counter({k: 0 for k in KINDS})

    def _start_trace(self):
        self.fingerprint = hashlib.blake2b(digest_size=8)
        self.trace = []  # (kind, group tag, bucket, elements), the first TRACE_LIMIT since the last check

    def _record(self, kind: int, key, numel: int):
        entry = (kind, *key, numel)
        self.fingerprint.update(repr(entry).encode())
        if len(self.trace) < self.TRACE_LIMIT:
            self.trace.append(entry)

    # Data plane -----------------------------------------------------------
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, key, async_op=False, count=True):
        """output (N x shard) <- every rank's shard; in place when shard is
        this rank's block of output. key: (group tag, bucket)."""
        self._record(0, key, output.numel())
        if count:
            self.stats["all_gather"] += output.numel()
        if not self.distributed:
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return _Done()
        work = _all_gather_single(output, shard, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def reduce_scatter(self, shard: torch.Tensor, input: torch.Tensor, key, async_op=False):
        """shard <- this rank's block of the sum of every rank's input; in
        place when shard is this rank's block of input. key: (group tag, bucket)."""
        self._record(1, key, input.numel())
        self.stats["reduce_scatter"] += input.numel()
        if not self.distributed:
            if shard.data_ptr() != input.data_ptr():
                shard.copy_(input)
            return _Done()
        work = _reduce_scatter_single(shard, input, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def all_reduce(self, tensor: torch.Tensor, key, async_op=False):
        self._record(2, key, tensor.numel())
        self.stats["all_reduce"] += tensor.numel()
        if not self.distributed:
            return _Done()
        work = dist.all_reduce(tensor, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    # Control plane (uncounted) --------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src_rank: int = 0):
        if self.distributed:
            dist.broadcast(tensor, dist.get_global_rank(self.group, src_rank), group=self.group)

    def sum_scalars(self, values):
        """Sums a list of floats over ranks (float64)."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.distributed:
            dist.all_reduce(t, group=self.group)
        return t.tolist()

    def gather_ints(self, value: int) -> list:
        """Every rank's int, in rank order."""
        return [row[0] for row in self._gather_rows([value], torch.int64)]

    def sum_checking_order(self, values, describe) -> list:
        """Sums floats over ranks (in rank order, so every rank gets the same
        bits) and, in the same collective, checks that every rank issued the
        same data-plane collectives since the last call; raises
        CollectiveOrderError on every rank if not. describe(tag) names a
        flat group for the message."""
        trace, digest = self.trace, self.fingerprint.digest()
        self._start_trace()
        fingerprint = float(int.from_bytes(digest, "little") >> 12)  # 52 bits: exact in float64
        rows = self._gather_rows([*values, fingerprint], torch.float64)
        if len({row[-1] for row in rows}) > 1:
            raise CollectiveOrderError(self._divergence(trace, describe))
        return [sum(column) for column in zip(*(row[:-1] for row in rows))]

    def _divergence(self, trace, describe) -> str:
        """The error path: ranks exchange their traces and name the first
        collective where they parted."""
        lengths = self.gather_ints(len(trace))
        longest = max(lengths)
        mine = [x for entry in trace for x in entry] + [-1] * (4 * (longest - len(trace)))
        rows = self._gather_rows(mine, torch.int64)
        traces = [[tuple(row[i:i + 4]) for i in range(0, 4 * n, 4)] for row, n in zip(rows, lengths)]
        first = next((i for i in range(longest) if len({t[i] if i < len(t) else None for t in traces}) > 1), None)
        if first is None:
            return (f"zerocore: ranks issued different collectives since the last step, after the first "
                    f"{longest:,}, which agree. Nothing was updated. Every rank must issue the same collectives in "
                    "the same order.")

        def what(t):
            if first >= len(t):
                return "nothing more before the step"
            kind, tag, bucket, numel = t[first]
            return f"{KINDS[kind]} of {describe(tag)}, bucket {bucket} ({numel:,} elements)"

        ranks = "\n".join(f"  rank {r}: {what(t)}" for r, t in enumerate(traces))
        return (f"zerocore: ranks issued different collectives since the last step; collective #{first + 1} was\n"
                f"{ranks}\nNothing was updated. Every rank must issue the same collectives in the same order: in "
                "stage 3 every rank must run the same units in the same order, so a module that ranks run or "
                "skip depending on their data (experts chosen by routing) must sit inside a unit that every rank "
                "runs: pass wrap(..., units=[the layer holding the experts]).")

    def _gather_rows(self, values, dtype) -> list:
        """Every rank's list of numbers (all of one length), in rank order."""
        t = torch.tensor(values, dtype=dtype)
        if not self.distributed:
            return [t.tolist()]
        out = torch.empty(self.world_size * t.numel(), dtype=dtype)
        _all_gather_single(out, t, group=self.group)
        return out.view(self.world_size, -1).tolist()
