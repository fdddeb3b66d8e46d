"""Grads accumulate in place in the reduce staging (issue 20, item 5): at
stages 2 and 3 a param's .grad is its view into its bucket's staging buffer
before autograd produces its grad, so autograd adds into it and the native
BucketReducer's grad_ready only notes it, instead of copying a .grad that
autograd allocated. Stage 3 takes a group's views before its unit's
backward (one call a group); stage 2 is handed them as buckets take
staging (the first bucket at the start of backward, the next as the one
before goes out), so only params that span buckets, or whose grads come
before their bucket's turn, are copied. The views never outlive the
backward, a failed one included; a user's hook may change a grad in its
view or replace it (the view then takes the new value, so the grad counts
once). The trained values are compared with single-process torch
here for those, and in test_engine_equivalence.py (accumulation, bucket
sizes) and test_engine_models.py (late grads) for the rest."""
import pytest
import torch

import zerocore
from dist_harness import run_ranks
from models import assert_state_close, engine_train, lm_batch, lm_loss, local, make, reference_train

LARGE = 1 << 20  # bytes per bucket: one bucket a group
HP = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99))


class Recording:
    """The native BucketReducer, with the grad views it hands out and, per
    grad it is given, whether that grad is the param's view (autograd
    accumulated in place) or a tensor autograd allocated (copied)."""

    def __init__(self, native):
        self.native = native
        self.handed = {}  # (group, param) -> the address of its view, this backward
        self.arrivals = []  # (group, param, in place), in arrival order

    def __getattr__(self, name):
        return getattr(self.native, name)

    def _note(self, views):
        for i, j, view in views:
            self.handed[(i, j)] = view.data_ptr
        return views

    def begin_backward(self):
        return self._note(self.native.begin_backward())

    def grad_views(self, i):
        views = self.native.grad_views(i)
        self._note([(i, j, v) for j, v in enumerate(views) if v is not None])
        return views

    def grad_ready(self, i, j, grad):
        self.arrivals.append((i, j, self.handed.get((i, j)) == grad.data_ptr()))
        return self._note(self.native.grad_ready(i, j, grad))

    def end_backward(self):
        self.handed.clear()
        return self.native.end_backward()


def _arrivals(rank, world, stage, bucket_bytes):
    model = make()
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), **HP),
                           zerocore.Config(stage=stage, bucket_bytes=bucket_bytes))
    recording = engine.parts.reducer.native = Recording(engine.parts.reducer.native)
    steps = []
    for step in range(2):
        recording.arrivals = []
        x, y = lm_batch(step, 0, world)
        engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
        engine.step()
        engine.zero_grad()
        steps.append(recording.arrivals)
    # Per group of the reduction order, per param: its (first, last) bucket.
    buckets = [[(s.first_bucket, s.last_bucket) for s in g.slots] for g in engine.parts.reducer.groups]
    return steps, buckets


@pytest.mark.parametrize("stage,bucket_bytes", [(2, LARGE), (2, 512), (3, LARGE), (3, 512)])
def test_grads_accumulate_in_their_views(stage, bucket_bytes):
    for steps, buckets in run_ranks(_arrivals, 2, stage, bucket_bytes):
        whole = {(i, j) for i, g in enumerate(buckets) for j, (first, last) in enumerate(g) if first == last}
        spanning = {(i, j) for i, g in enumerate(buckets) for j in range(len(g))} - whole
        for arrivals in steps:
            assert sorted((i, j) for i, j, _ in arrivals) == sorted(whole | spanning)  # each param's grad once
            in_place = {(i, j) for i, j, ok in arrivals if ok}
            assert not in_place & spanning  # a param spanning buckets is copied into each
            # Stage 3: every param in one bucket. Stage 2: every param in one
            # bucket whose grad comes once the params of every bucket before
            # its own have reported (it is that bucket's turn): TinyLM's grads
            # come in plan order, so all of them.
            seen, in_turn = set(), set()
            for i, j, _ in arrivals:
                first = buckets[i][j][0]
                before = {(gi, pj) for gi, g in enumerate(buckets) for pj, (_, last) in enumerate(g)
                          if gi < i or (gi == i and last < first)}
                if (i, j) in whole and (stage == 3 or before <= seen):
                    in_turn.add((i, j))
                seen.add((i, j))
            assert in_turn == whole, "TinyLM's grads no longer come in plan order"
            assert in_place == whole, (sorted(whole - in_place), sorted(in_place - whole))


class _Fail(torch.autograd.Function):
    """Identity whose backward raises while `armed`."""
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _Fail.armed:
            raise RuntimeError("a backward that fails midway")
        return grad


def _train_after_failed_backward(rank, world, stage):
    model = make()
    block = model.blocks[0]
    block.register_forward_hook(lambda m, args, out: _Fail.apply(out))  # behind block 1's backward
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), **HP),
                           zerocore.Config(stage=stage, bucket_bytes=LARGE))
    x, y = lm_batch(99, 0, world)
    _Fail.armed = True
    try:
        engine.backward(lm_loss(engine(local(x, rank, world)), local(y, rank, world)))
    except RuntimeError as e:
        assert "fails midway" in str(e)
    else:
        raise AssertionError("the backward did not fail")
    _Fail.armed = False
    # Block 0's params and the embedding got no grad: their views went with the backward.
    leaked = [n for n, p in model.named_parameters() if p.grad is not None]
    engine.zero_grad()
    return leaked, engine_train(engine, rank, world, 3, 2)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_failed_backward_leaves_no_grad_view_and_training_goes_on(stage):
    model = make()
    block = model.blocks[0]
    block.register_forward_hook(lambda m, args, out: _Fail.apply(out))
    ref = reference_train(model, torch.optim.AdamW(model.parameters(), **HP), 3, 2, 2)
    for rank, (leaked, got) in enumerate(run_ranks(_train_after_failed_backward, 2, stage)):
        assert leaked == [], f"rank {rank}: .grad left after the failed backward: {leaked}"
        assert_state_close(got, ref, rtol=1e-5, atol=1e-5, what=f"stage {stage} rank {rank}")


def _shift(p):  # not a scale, which Adam's update would hide
    p.grad.add_(0.01)


def _replace(p):  # a new tensor in the view's place
    p.grad = p.grad + 0.01


def _train_with_hooks(rank, world, stage, hook):
    model = make()
    for p in model.parameters():  # before wrap: they run before the engine takes the grad
        p.register_post_accumulate_grad_hook(hook)
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), **HP),
                           zerocore.Config(stage=stage, bucket_bytes=512))
    return engine_train(engine, rank, world, 3, 1)  # torch's hook would shift the sum of earlier micro-batches again


@pytest.mark.parametrize("hook", [_shift, _replace])
@pytest.mark.parametrize("stage", [2, 3])
def test_a_users_hook_changes_or_replaces_grads_as_in_torch(stage, hook):
    model = make()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    ref = reference_train(model, torch.optim.AdamW(model.parameters(), **HP), 3, 1, 2)
    for rank, got in enumerate(run_ranks(_train_with_hooks, 2, stage, hook)):
        assert_state_close(got, ref, rtol=1e-5, atol=1e-5, what=f"stage {stage} rank {rank}")
