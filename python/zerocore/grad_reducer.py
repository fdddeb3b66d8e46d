"""Gradient reduction across data-parallel ranks.

FullGradReducer (stages 0-1): autograd accumulates into views of each
group's flat grad buffer; at the step boundary every bucket is all-reduced
(stage 0) or reduce-scattered in place (stage 1), once per step however
many backward calls came before.

StagedReducer (stages 2-3): autograd's per-param grad is copied, as soon as
it is accumulated, into a staging buffer of its bucket and then dropped; a
bucket whose params have all reported is reduce-scattered and its shard
added into the group's partition grads, so only the partition and a few
constant-size staging buffers outlive backward.

Buckets are reduced in one fixed order on every rank (the plan's, groups in
backward order), whatever order their grads arrive in: a bucket that is
ready waits for the ones before it. Ranks whose grads differ (a param
unused on one rank) therefore still issue the same collectives in the same
order, and nothing hangs. Params that produced no grad count as zero; a
param whose grad arrives again after its bucket was reduced (reentrant
checkpointing) gets its bucket reduced again at the end of backward.
"""
from __future__ import annotations

import weakref

import torch

from zerocore.comm import Communicator


def _hook_each(params, method):
    """Registers method as every param's post-accumulate-grad hook. The hooks
    live on the params, where the garbage collector cannot see them, so they
    hold the reducer weakly, or it would never be freed."""
    ref = weakref.WeakMethod(method)
    return [p.register_post_accumulate_grad_hook(lambda p: ref() and ref()(p)) for p in params]


class FullGradReducer:
    def __init__(self, groups, comm: Communicator, placement):
        self.groups = [g for g in groups if g.trainable]
        self.comm = comm
        self.placement = placement
        # A .grad must have its param's dtype: with another reduce dtype,
        # each grad is added into the buffer (converted) once accumulated.
        self.converted = {id(p): (g, i) for g in self.groups if g.reduce_dtype != g.dtype
                          for i, p in enumerate(g.params)}
        self.hooks = _hook_each([g.params[i] for g, i in self.converted.values()], self._on_grad)

    def before_backward(self):
        for g in self.groups:
            if g.reduce_dtype == g.dtype:
                g.attach_grad_views()

    def _on_grad(self, p):
        g, i = self.converted[id(p)]
        slot = g.slots[i]
        g.grad_full[slot.offset:slot.offset + slot.numel].add_(p.grad.reshape(-1))
        p.grad = None

    def after_backward(self):
        pass

    def reduce(self):
        works = []
        for g in self.groups:
            for b in range(len(g.buckets)):
                bucket = g.grad_full[g.bucket_slice(b)]
                if not self.placement.partitions_optimizer:
                    works.append(self.comm.all_reduce(bucket, (g.tag, b), async_op=True))
                else:
                    works.append(self.comm.reduce_scatter(g.grad_full[g.shard_slice(b)], bucket, (g.tag, b),
                                                          async_op=True))
        for w in works:
            w.wait()


class _Slot:
    """One bucket of one group on its way through reduction."""

    __slots__ = ("group", "bucket", "params", "waiting", "staging", "issued", "dirty")

    def __init__(self, group, bucket, params):
        self.group, self.bucket, self.params = group, bucket, params
        self.waiting = set(params)
        self.staging = None
        self.issued = False
        self.dirty = False


class StagedReducer:
    # Reductions allowed in flight before the oldest is completed: one keeps
    # each reduction overlapped with the next bucket's backward while the
    # staging memory stays at two buckets.
    MAX_IN_FLIGHT = 1

    def __init__(self, groups, comm: Communicator):
        self.comm = comm
        self.slots = []
        self.pieces = {}  # id(param) -> [(slot, param slice, staging slice)]
        self._pool = {}
        self.pool_bytes = 0
        for g in (g for g in groups if g.trainable):
            for b, bucket in enumerate(g.buckets):
                idx = [i for i in range(bucket.first_param, bucket.last_param + 1) if g.slots[i].numel > 0]
                slot = _Slot(g, b, [id(g.params[i]) for i in idx])
                self.slots.append(slot)
                for i in idx:
                    s = g.slots[i]
                    lo, hi = max(s.offset, bucket.offset), min(s.offset + s.numel, bucket.offset + bucket.numel)
                    self.pieces.setdefault(id(g.params[i]), []).append(
                        (slot, slice(lo - s.offset, hi - s.offset), slice(lo - bucket.offset, hi - bucket.offset)))
        self.hooks = _hook_each([p for g in groups if g.trainable for p in g.params], self._on_grad)
        self._reset()

    def _reset(self):
        self.next = 0
        self.in_flight = []
        self.viewed = []  # params whose .grad is a view into a staging buffer
        for s in self.slots:
            s.waiting = set(s.params)
            s.issued = s.dirty = False

    # Staging buffers come from a small pool keyed by size and dtype.
    def _take(self, slot) -> torch.Tensor:
        n, dtype = slot.group.buckets[slot.bucket].numel, slot.group.reduce_dtype
        free = self._pool.get((n, dtype))
        if free:
            return free.pop().zero_()
        self.pool_bytes += n * torch.finfo(dtype).bits // 8
        return torch.zeros(n, dtype=dtype)

    def before_backward(self):
        pass

    def attach_grad_views(self, group):
        """Stage 3, before a unit's backward: each param's .grad becomes its
        view into its bucket's staging buffer, so autograd accumulates there
        in place (no per-param allocation, no copy). Params that straddle
        buckets, and buckets already reduced, keep the copy path."""
        for p, shape in zip(group.params, group.shapes):
            pieces = self.pieces.get(id(p), ())
            if p.grad is not None or len(pieces) != 1 or pieces[0][0].issued or group.reduce_dtype != group.dtype:
                continue
            slot, _, dst = pieces[0]
            if slot.staging is None:
                slot.staging = self._take(slot)
            p.grad = slot.staging[dst].view(shape)
            self.viewed.append(p)

    def _on_grad(self, p):
        grad = p.grad.reshape(-1)
        for slot, src, dst in self.pieces[id(p)]:
            if slot.staging is None:
                slot.staging = self._take(slot)
            target = slot.staging[dst]
            if grad.data_ptr() != target.data_ptr():  # not accumulated in place
                target.add_(grad[src])
            if slot.issued:
                slot.dirty = True
            slot.waiting.discard(id(p))
        p.grad = None
        self._issue_ready()

    def _issue_ready(self):
        while self.next < len(self.slots) and not self.slots[self.next].waiting:
            self._issue(self.slots[self.next])
            self.next += 1

    def _issue(self, slot):
        if slot.staging is None:  # no grads here on this rank: reduce zeros
            slot.staging = self._take(slot)
        staging, slot.staging = slot.staging, None  # later grads go to a fresh buffer
        work = self.comm.reduce_scatter(staging[self._local(slot)], staging, (slot.group.tag, slot.bucket),
                                        async_op=True)
        slot.issued, slot.dirty = True, False
        self.in_flight.append((slot, work, staging))
        while len(self.in_flight) > self.MAX_IN_FLIGHT:
            self._complete(*self.in_flight.pop(0))

    def _local(self, slot) -> slice:
        n = slot.group.plan.shard_elems(slot.bucket)
        return slice(slot.group.rank * n, (slot.group.rank + 1) * n)

    def _complete(self, slot, work, staging):
        work.wait()
        g = slot.group
        g.grad_part[g.partition_slice(slot.bucket)].add_(staging[self._local(slot)])
        self._pool.setdefault((staging.numel(), staging.dtype), []).append(staging)

    def after_backward(self):
        """End of backward: reduce every bucket not yet reduced (params that
        got no grad count as zero), then buckets that got late grads."""
        # Views of params that got no grad must not outlive their buffers.
        for p in self.viewed:
            p.grad = None
        for slot in self.slots[self.next:]:
            slot.waiting.clear()
        self._issue_ready()
        # Late grads may have come on some ranks only: agree on which buckets
        # to reduce again, so every rank issues the same collectives.
        dirty = self.comm.sum_scalars([float(s.dirty) for s in self.slots]) if self.slots else []
        for slot, d in zip(self.slots, dirty):
            if d:
                self._issue(slot)
        while self.in_flight:
            self._complete(*self.in_flight.pop(0))
        self._reset()

    def reduce(self):
        pass
