"""The layout planner: offsets, constant-size buckets, rank partitions."""
import random

import pytest

from zerocore import LayoutPlan


def check_plan(numels, world, align, bucket, groups=None):
    plan = LayoutPlan.make(numels, groups=groups or [], world_size=world, align_elems=align,
                           bucket_elems=bucket)
    slots, buckets = plan.params, plan.buckets
    unit = world * align
    # Params: in order, aligned, not overlapping.
    end = 0
    for slot, n in zip(slots, numels):
        assert slot.numel == n and slot.offset % align == 0 and slot.offset >= end
        end = slot.offset + n
    assert plan.padding_elems == plan.total_elems - sum(numels)
    if end == 0:
        assert plan.total_elems == 0 and not buckets
        return plan
    # Buckets tile the buffer: all but the last have the constant size
    # (the bucket size rounded up to world * align), the last only what the
    # remaining params need, rounded up the same way.
    round_up = lambda n: -(-n // unit) * unit
    step = round_up(bucket) if bucket else round_up(end)
    off = 0
    for i, b in enumerate(buckets):
        assert b.offset == off and b.numel % unit == 0 and b.numel > 0
        if i + 1 < len(buckets):
            assert b.numel == step
        off += b.numel
    assert buckets[-1].numel == min(step, round_up(end - buckets[-1].offset))
    assert off == plan.total_elems and 0 <= plan.total_elems - end < unit
    assert plan.partition_elems * world == plan.total_elems
    # Every element of every param is owned by exactly one rank, and the
    # segments' three coordinate systems agree.
    owner = [[-1] * n for n in numels]
    for rank in range(world):
        part = 0
        for seg in plan.segments(rank):
            slot = slots[seg.param]
            assert seg.flat_offset == slot.offset + seg.param_offset
            assert seg.group == slot.group
            b = slot.first_bucket + next(
                k for k in range(slot.last_bucket - slot.first_bucket + 1)
                if buckets[slot.first_bucket + k].offset <= seg.flat_offset
                < buckets[slot.first_bucket + k].offset + buckets[slot.first_bucket + k].numel)
            lo = plan.shard_offset(b, rank)
            assert lo <= seg.flat_offset and seg.flat_offset + seg.numel <= lo + plan.shard_elems(b)
            assert seg.partition_offset == plan.partition_offset(b) + seg.flat_offset - lo
            assert seg.partition_offset >= part  # flat order
            part = seg.partition_offset + seg.numel
            for k in range(seg.param_offset, seg.param_offset + seg.numel):
                assert owner[seg.param][k] == -1, "element owned twice"
                owner[seg.param][k] = rank
        assert part <= plan.partition_elems
    assert all(o != -1 for row in owner for o in row), "element owned by no rank"
    # Bucket <-> param overlap bookkeeping.
    for i, slot in enumerate(slots):
        if slot.numel == 0:
            continue
        for b in range(slot.first_bucket, slot.last_bucket + 1):
            bk = buckets[b]
            assert bk.first_param <= i <= bk.last_param
            assert bk.offset < slot.offset + slot.numel and slot.offset < bk.offset + bk.numel
    return plan


@pytest.mark.parametrize("world", range(1, 9))
def test_odd_shapes_every_world_size(world):
    numels = [3 * 5, 7, 1, 1000, 33 * 17, 2, 0, 129, 64 * 3]
    for align in (1, 4, 16):
        for bucket in (0, 1, 5, 64, 100, 1 << 20):
            check_plan(numels, world, align, bucket)


def test_param_larger_than_bucket_straddles_buckets_and_ranks():
    plan = check_plan([10, 1000, 10], world=4, align=4, bucket=64)
    big = plan.params[1]
    assert big.last_bucket - big.first_bucket + 1 >= 1000 // 64
    owners = {s.param for r in range(4) for s in plan.segments(r) if s.param == 1}
    assert owners == {1}
    assert all(any(s.param == 1 for s in plan.segments(r)) for r in range(4))


def test_thousands_of_tiny_params():
    rng = random.Random(1234)
    numels = [rng.randint(1, 9) for _ in range(3000)]
    for world in (1, 3, 8):
        check_plan(numels, world, align=2, bucket=256)


def test_random_layouts(gen):
    rng = random.Random(int(gen.initial_seed()))
    for _ in range(60):
        numels = [rng.choice([0, 1, rng.randint(1, 50), rng.randint(50, 5000)]) for _ in range(rng.randint(1, 12))]
        groups = [rng.randint(0, 2) for _ in numels]
        check_plan(numels, rng.randint(1, 8), rng.choice([1, 2, 8, 32]), rng.choice([0, 1, 7, 128, 4096]), groups)


def test_empty_model():
    plan = check_plan([], world=2, align=8, bucket=64)
    assert plan.segments(0) == [] and plan.buckets == []
    check_plan([0, 0], world=3, align=8, bucket=64)


def test_fingerprint_is_stable_and_sensitive():
    a = LayoutPlan.make([10, 20, 30], world_size=2, align_elems=4, bucket_elems=16).fingerprint
    assert a == LayoutPlan.make([10, 20, 30], world_size=2, align_elems=4, bucket_elems=16).fingerprint
    for other in (
        LayoutPlan.make([10, 20, 31], world_size=2, align_elems=4, bucket_elems=16),
        LayoutPlan.make([10, 30, 20], world_size=2, align_elems=4, bucket_elems=16),
        LayoutPlan.make([10, 20, 30], world_size=4, align_elems=4, bucket_elems=16),
        LayoutPlan.make([10, 20, 30], world_size=2, align_elems=8, bucket_elems=16),
        LayoutPlan.make([10, 20, 30], world_size=2, align_elems=4, bucket_elems=32),
        LayoutPlan.make([10, 20, 30], groups=[0, 1, 0], world_size=2, align_elems=4, bucket_elems=16),
    ):
        assert other.fingerprint != a


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        LayoutPlan.make([4], world_size=0)
    with pytest.raises(ValueError, match="align_elems"):
        LayoutPlan.make([4], align_elems=0)
    with pytest.raises(ValueError, match="negative"):
        LayoutPlan.make([4, -1])
    with pytest.raises(ValueError, match="groups"):
        LayoutPlan.make([4, 5], groups=[0])
    plan = LayoutPlan.make([4], world_size=2)
    with pytest.raises(ValueError, match="rank"):
        plan.segments(2)
    with pytest.raises(ValueError, match="bucket"):
        plan.shard_offset(5, 0)
