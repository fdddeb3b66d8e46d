"""Views into a flat group's buffers, by layout: a param's, a bucket's, a
run's, a segment's, each a slice the native store computes (no offset is
computed here), as plain functions of the store and the tensor sliced. A
tensor is one of the store's buffers (FlatGroup.buffers) or any whole or
partition-sized tensor of its plan (a gather pool slot, a temporary).
Nothing here touches the module's params (binding.py binds them) or knows
which buffers a group holds (flat_group.py).
"""
from __future__ import annotations

import torch

from zerocore._native import PartitionStore

# PartitionStore's spans, each (elements of the tensor sliced, its indices) -> (first element, elements):
# "param" (param i), "bucket" (bucket b of a partition), "shard" (rank r's block of bucket b of a whole
# buffer), "run" (run k of a partition), "segment" (segment s of a partition).
_SPANS = {"param": PartitionStore.param_span, "bucket": PartitionStore.bucket_span,
          "shard": PartitionStore.shard_span, "run": PartitionStore.run_span,
          "segment": PartitionStore.segment_span}


def view(store, t: torch.Tensor, span: str, *args) -> torch.Tensor:
    """The slice of `t` at the store's span `span` (_SPANS; args: its indices)."""
    lo, n = _SPANS[span](store, t.numel(), *args)
    return t[lo:lo + n]


def partition_from_flat(store, buckets: int, rank: int, flat: torch.Tensor, out: torch.Tensor):
    """Copies rank `rank`'s block of each of the plan's `buckets` buckets of
    `flat` (a whole buffer) into `out` (a partition-sized one, any dtype)."""
    for b in range(buckets):
        view(store, out, "bucket", b).copy_(view(store, flat, "shard", b, rank))


def flat_from_partitions(store, buckets: int, partitions: torch.Tensor, flat: torch.Tensor):
    """Copies every rank's partition (the rows of `partitions`, one a rank)
    into its blocks of `flat`, the whole buffer: partition_from_flat's inverse."""
    for r, partition in enumerate(partitions):
        for b in range(buckets):
            view(store, flat, "shard", b, r).copy_(view(store, partition, "bucket", b))


def stretches(store, buffers: list, index: int) -> list:
    """(first element, elements, views) of each piece of param `index` in
    `buffers`, which have one layout (all whole or all partitions)."""
    return [(first, span.numel, [b[span.offset:span.offset + span.numel] for b in buffers])
            for first, span in store.param_spans(buffers[0].numel(), index)]


def load(pieces, read):
    """Fills `pieces` (stretches') with read(first, n): elements
    first..first+n-1 of the flattened param or state, in any floating dtype."""
    for first, n, outs in pieces:
        values = read(first, n)
        for out in outs:
            out.copy_(values)


def owned_stretches(store, segments: list, partition: torch.Tensor) -> list:
    """(param index, first element, values) of each stretch of this rank's
    partition (its `segments`, the store's), from `partition` (a partition-sized tensor)."""
    return [(seg.param, seg.param_offset, view(store, partition, "segment", i))
            for i, seg in enumerate(segments)]
