"""fp32 training against single-process torch where the gradient's scale
shows. Adam divides each update by the grad's own magnitude, so a uniform
factor lost or added (the 1/world average, the sum over accumulated
micro-batches, a clipping coefficient) leaves it almost unchanged; SGD
without momentum moves each param by lr x grad, so the same factor moves
every param by that factor. Hence SGD, at every stage: with accumulation 2
and 3 at worlds 2 and 4; with a max_grad_norm that some steps' grads exceed
and others do not; stage 3 with params kept whole (persist_threshold); and
50 steps per stage whose loss falls and equals torch's at every step.
"""
import pytest
import torch

import zerocore
from dist_harness import run_ranks
from mixed_precision_reference import assert_moved_like
from models import engine_train, lm_batch, make, reference_train

STAGES = (0, 1, 2, 3)
STEPS = 5
SMALL = 1024  # bytes per bucket: the matrices straddle buckets and ranks
# fp32 sums in another order than torch's differ by a few ulps; after 5
# steps the worst param is about 1e-6 of its movement off.
BOUND = 1e-4


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _train_stages(rank, world, opt_fn, config, steps, accum, batch=lm_batch, stages=STAGES):
    """{stage: (full state dict, this rank's losses)}."""
    out = {}
    for stage in stages:
        model = make()
        engine = zerocore.wrap(model, opt_fn(model.parameters()), dict(config, stage=stage))
        losses = []
        out[stage] = engine_train(engine, rank, world, steps, accum, batch=batch, losses=losses), losses
    return out


def _assert_close_to(results, ref, initial, what):
    for rank, by_stage in enumerate(results):
        for stage, (state, _) in by_stage.items():
            assert_moved_like(state, ref, initial, BOUND, f"{what}, rank {rank}, stage {stage}")


def _reference(opt_fn, steps, accum, world, batch=lm_batch, clip=None):
    """torch's run, its initial state, its losses and, per step, the grad
    norm (before clipping to `clip`)."""
    model = make()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt, losses, norms = opt_fn(model.parameters()), [], []

    class Clipped:  # torch.nn.utils.clip_grad_norm_ between backward and the step
        def step(self):
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))))
            opt.step()

        def zero_grad(self):
            opt.zero_grad()

    ref = reference_train(model, Clipped(), steps, accum, world, batch=batch, losses=losses)
    return ref, initial, losses, norms


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("accum", [2, 3])
def test_sgd_with_accumulation(world, accum):
    """The grads summed over micro-batches and averaged over ranks."""
    results = run_ranks(_train_stages, world, sgd, {"bucket_bytes": SMALL}, STEPS, accum, timeout=120)
    ref, initial, _, _ = _reference(sgd, STEPS, accum, world)
    _assert_close_to(results, ref, initial, f"world {world}, accumulation {accum}")


MAX_NORM = 7.0


def test_clipping_that_some_steps_cross():
    """The first steps' grad norms exceed MAX_NORM and are clipped, the later
    ones' do not: the clipping coefficient and the condition both count."""
    results = run_ranks(_train_stages, 2, sgd, {"bucket_bytes": SMALL, "max_grad_norm": MAX_NORM}, STEPS, 2)
    ref, initial, _, norms = _reference(sgd, STEPS, 2, 2, clip=MAX_NORM)
    # Away from the threshold, so that rounding cannot tip a step either way.
    assert any(n > 1.05 * MAX_NORM for n in norms) and any(n < 0.95 * MAX_NORM for n in norms), norms
    assert not any(0.99 * MAX_NORM < n < 1.01 * MAX_NORM for n in norms), norms
    _assert_close_to(results, ref, initial, "clipping")


PERSIST = 40


def _train_keeping_params_whole(rank, world):
    """Stage 3 with persist_threshold: {3: (the state, None)} as
    _train_stages gives it, and the names of the params the engine keeps
    whole (its unsharded groups)."""
    model = make()
    engine = zerocore.wrap(model, sgd(model.parameters()),
                           {"bucket_bytes": SMALL, "persist_threshold": PERSIST, "stage": 3})
    whole = {n for g in engine.parts.groups if not g.sharded for names in g.names for n in names}
    return {3: (engine_train(engine, rank, world, STEPS, 2), None)}, whole


def test_stage3_with_params_kept_whole():
    """persist_threshold: the biases and norms (< 40 elements) stay whole on
    every rank and are reduced apart from the partitioned matrices."""
    results = run_ranks(_train_keeping_params_whole, 2)
    small = {name for name, p in make().named_parameters() if p.numel() < PERSIST}
    assert small and all(whole == small for _, whole in results), (small, [whole for _, whole in results])
    ref, initial, _, _ = _reference(sgd, STEPS, 2, 2)
    _assert_close_to([states for states, _ in results], ref, initial, f"persist_threshold {PERSIST}")


LONG = 50


def _repeating_batches(step, micro, world):
    """Four global batches, over and over: a loss that can fall far."""
    return lm_batch(step % 4, micro, world)


def sgd_momentum(params):
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


def test_50_steps_loss_falls_and_equals_torch():
    results = run_ranks(_train_stages, 2, sgd_momentum, {"bucket_bytes": 4096}, LONG, 1, _repeating_batches,
                        timeout=180)
    ref, initial, losses, _ = _reference(sgd_momentum, LONG, 1, 2, batch=_repeating_batches)
    assert losses[-1] < 0.5 * losses[0], f"the loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}"
    for stage in STAGES:
        # The global batch's loss is the mean of the ranks' (equal halves).
        engine_losses = torch.tensor([results[0][stage][1], results[1][stage][1]], dtype=torch.float64).mean(0)
        torch.testing.assert_close(engine_losses, torch.tensor(losses, dtype=torch.float64), rtol=1e-5, atol=0,
                                   msg=lambda m: f"stage {stage}: the losses part from torch's: {m}")
    _assert_close_to(results, ref, initial, "50 steps")
