"""ZeRO training matches single-process PyTorch on the same global batch:
stages 0-3 x world sizes 1, 2, 4 x gradient accumulation 1 and 3 x bucket
sizes (tiny, so params straddle buckets and ranks; large), fp32 to 1e-5
relative; and the stages agree with each other. 16-bit training is compared
with a mixed-precision reference in test_mixed_precision.py.
"""
import pytest
import torch

import zerocore
from dist_harness import run_ranks
from models import assert_state_close, engine_train, make, reference_train

STEPS = 5
TINY, LARGE = 256, 1 << 20  # bytes per bucket: 64 fp32 elements, or everything
CONFIGS = [(stage, bucket) for stage in (0, 1, 2, 3) for bucket in (TINY, LARGE)]
# Adam normalises each update to about lr whatever the gradient's size, so a
# gradient that nearly cancels across ranks (summed in another order than in
# the reference) moves its param by up to lr in a different direction: the
# rounding noise of fp32 sums is bounded by lr, not by the gradient. A
# realistic lr keeps that noise below the 1e-5 relative bound.
HP = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99))


def train_every_config(rank, world, accum):
    out = {}
    for stage, bucket in CONFIGS:
        model = make()
        engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), **HP),
                               zerocore.Config(stage=stage, bucket_bytes=bucket))
        out[(stage, bucket)] = engine_train(engine, rank, world, STEPS, accum)
    return out


def reference(world, accum):
    model = make()
    return reference_train(model, torch.optim.AdamW(model.parameters(), **HP), STEPS, accum, world)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("accum", [1, 3])
def test_fp32_matches_reference(world, accum):
    results = run_ranks(train_every_config, world, accum, timeout=120)
    ref = reference(world, accum)
    for config in CONFIGS:
        for rank in range(world):
            assert_state_close(results[rank][config], ref, rtol=1e-5, atol=1e-6, what=f"rank {rank} {config}")
    # The stages agree with each other (all-reduce vs reduce-scatter sum in
    # different orders, so not bit for bit).
    base = results[0][CONFIGS[0]]
    for config in CONFIGS[1:]:
        assert_state_close(results[0][config], base, rtol=1e-6, atol=1e-7, what=f"{config} vs {CONFIGS[0]}")
