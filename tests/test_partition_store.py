"""zerocore.PartitionStore from Python: the buffers it plans and allocates,
and its spans, against the plan's own segments (test_store.cpp checks the
spans element by element against a brute-force layout)."""
import pytest
import torch

import zerocore
from zerocore import LayoutPlan, PartitionStore, _native


def make_store(plan, rank, **placement):
    args = dict(backend=_native.process_backend(), rank=rank, dtype="bf16", reduce_dtype="fp32", trainable=True, sharded=False,
                partitions_grads=True, params_on_host=False, optimizer_on_host=False,
                state_names=["exp_avg", "exp_avg_sq"])
    return PartitionStore(plan, **{**args, **placement})


def test_allocates_what_it_plans_zeroed_in_arenas():
    plan = LayoutPlan.make([37, 5, 100], world_size=2, align_elems=8, bucket_elems=48)
    store = make_store(plan, 1)
    planned = store.buffers
    assert [kind for kind, *_ in planned] == ["full", "master", "state.exp_avg", "state.exp_avg_sq", "grad_part"]
    assert store.planned_bytes("device") == plan.total_elems * 2 + plan.partition_elems * 4 * 4
    assert store.planned_bytes("host") == 0
    with pytest.raises(ValueError, match="allocate"):
        store.buffer("full")
    before = zerocore.host_arena_allocations()
    store.allocate()
    assert zerocore.host_arena_allocations() - before == len(planned)
    for kind, _, _, numel, dtype in planned:
        t = torch.from_dlpack(store.buffer(kind))
        assert t.numel() == numel and t.dtype == zerocore.state.flat_group.FROM_NATIVE[dtype] and not t.any()
    with pytest.raises(ValueError, match="keeps no 'shard' buffer"):
        store.buffer("shard")


def test_spans_follow_the_plans_segments(gen):
    numels = [int(n) for n in torch.randint(0, 60, (7,), generator=gen)]
    for world in (1, 3):
        plan = LayoutPlan.make(numels, world_size=world, align_elems=4, bucket_elems=32)
        for rank in range(world):
            store = make_store(plan, rank)
            segments = plan.segments(rank)
            assert [(s.param, s.partition_offset) for s in store.segments] == \
                [(s.param, s.partition_offset) for s in segments]
            for i, seg in enumerate(segments):
                assert tuple(store.segment_span(plan.partition_elems, i)) == (seg.partition_offset, seg.numel)
                assert tuple(store.segment_span(plan.total_elems, i)) == (seg.flat_offset, seg.numel)
            for p in range(len(numels)):
                pieces = [(s.param_offset, s.partition_offset, s.numel) for s in segments if s.param == p]
                got = [(first, *span) for first, span in store.param_spans(plan.partition_elems, p)]
                if world > 1:
                    assert got == pieces
                slot = plan.params[p]
                assert tuple(store.param_span(plan.total_elems, p)) == (slot.offset, slot.numel)


def test_a_buffer_of_another_size_is_refused():
    plan = LayoutPlan.make([10, 20], world_size=2, align_elems=1, bucket_elems=8)
    store = make_store(plan, 0)
    with pytest.raises(ValueError, match="neither the plan's"):
        store.bucket_span(plan.total_elems + 1, 0)
    with pytest.raises(ValueError, match="use param_spans"):
        store.param_span(plan.partition_elems, 0)
