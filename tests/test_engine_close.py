"""engine.close(): the module comes back as a plain torch module holding the
trained values, and what the engine made (native buffers, threads, hooks)
goes at once, with the garbage collector off: no reference cycle keeps it
until a later collection. The engine and its optimizer refuse further use,
and the module wraps again."""
import gc

import pytest
import torch

import zerocore
from dist_harness import run_ranks
from models import engine_train, lm_batch, local, make


def _train_then_close(rank, world, stage, dtype):
    gc.collect()
    gc.disable()
    try:
        base = zerocore.host_arena_bytes()
        model = make(layers=3)
        model.register_buffer("offset", torch.full((4,), 0.5))  # cast to the training dtype at wrap
        model.blocks[0].register_buffer("scratch", torch.zeros(3), persistent=False)
        engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                               zerocore.Config(stage=stage, dtype=dtype, bucket_bytes=256))
        engine_train(engine, rank, world, steps=2, accum=1)
        trained = engine.full_state_dict()
        x = local(lm_batch(5, 0, world)[0], rank, world)
        with torch.no_grad():
            engine_out = engine(x).float()
        optimizer = engine.optimizer
        module = engine.close()
        left = zerocore.host_arena_bytes() - base
    finally:
        gc.enable()
    with torch.no_grad():
        module_out = module(x)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    dtypes = {module.offset.dtype, module.blocks[0].scratch.dtype}
    errors = []
    for call in (lambda: engine.step(), lambda: optimizer.step(), lambda: engine(x)):
        with pytest.raises(RuntimeError, match="closed") as e:
            call()
        errors.append(str(e.value))
    # The module wraps again and trains.
    again = zerocore.wrap(module, torch.optim.AdamW(module.parameters(), lr=1e-2), zerocore.Config(stage=stage))
    engine_train(again, rank, world, steps=1, accum=1)
    return left, trained, state, engine_out, module_out, dtypes, errors


@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (1, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")])
def test_close_hands_back_the_trained_module_and_frees_everything_at_once(stage, dtype):
    for rank, (left, trained, state, engine_out, module_out, buffer_dtypes, errors) in enumerate(
            run_ranks(_train_then_close, 2, stage, dtype)):
        assert left == 0, f"rank {rank}: {left} bytes of native buffers outlive close()"
        assert state.keys() == trained.keys()
        for k, v in trained.items():
            assert state[k].dtype == torch.float32 and torch.equal(state[k], v.float()), f"rank {rank}: {k}"
        assert buffer_dtypes == {torch.float32}
        if dtype == "fp32":  # the plain module computes what the engine did
            assert torch.equal(module_out, engine_out), f"rank {rank}"
        assert all("close()" in e for e in errors), errors
