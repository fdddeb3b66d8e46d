"""engine.save / engine.load / zerocore.io.export: a resumed run continues as
the uninterrupted one (bitwise at the same world size and stage, within the
equivalence tolerance across them); broken checkpoints fail on every rank
with the engine unchanged; a save that fails or dies leaves the previous
checkpoint loadable; the export loads into a plain model."""
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import zerocore
from dist_harness import run_ranks
from mixed_precision_reference import assert_moved_like, mp_reference_train
from models import TinyLM, assert_state_close, lm_batch, lm_loss, local, make, reference_train

LR = 1e-2  # large enough that a step taken wrong shows


class DropoutLM(TinyLM):
    """TinyLM with dropout on the embeddings: resuming needs the RNG states."""

    def forward(self, idx):
        x = F.dropout(self.embed(idx), 0.2, self.training)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def _engine(stage, dtype="fp32", seed=0, layers=2):
    model = make(DropoutLM, seed=seed, layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    engine = zerocore.wrap(model, opt, {"stage": stage, "dtype": dtype, "bucket_bytes": 512})
    scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.7)
    return engine, scheduler


def _train(engine, scheduler, rank, world, steps, accum=2):
    """Steps of the same global batches (of 8 sequences) at any world size."""
    losses = []
    for step in steps:
        for micro in range(accum):
            x, y = lm_batch(step, micro, world=4)
            loss = lm_loss(engine(local(x, rank, world)), local(y, rank, world))
            engine.backward(loss)
            losses.append(loss.item())
        engine.step()
        engine.zero_grad()
        scheduler.step()
    return losses


def _save_then_continue(rank, world, stage, dtype, path):
    """Trains 2 steps, saves, trains 2 more: the uninterrupted run."""
    engine, scheduler = _engine(stage, dtype)
    torch.manual_seed(100 + rank)  # dropout differs per rank, as it would
    _train(engine, scheduler, rank, world, range(2))
    engine.save(path, lr_scheduler=scheduler, extra={"epoch": 3, "rank0_seen": world})
    losses = _train(engine, scheduler, rank, world, range(2, 4))
    return engine.full_state_dict(), losses, scheduler.get_last_lr()


def _resume(rank, world, stage, dtype, path):
    """A fresh engine (other initial values, other RNG) loads and trains the last 2 steps."""
    engine, scheduler = _engine(stage, dtype, seed=1)
    torch.manual_seed(7)  # the checkpoint's RNG states replace this
    extra = engine.load(path, lr_scheduler=scheduler)
    assert engine.step_count == 2
    losses = _train(engine, scheduler, rank, world, range(2, 4))
    return engine.full_state_dict(), losses, scheduler.get_last_lr(), extra


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_is_bitwise_the_uninterrupted_run(stage, tmp_path):
    path = str(tmp_path / "ckpt")
    straight = run_ranks(_save_then_continue, 2, stage, "fp32", path)
    resumed = run_ranks(_resume, 2, stage, "fp32", path)
    for rank in range(2):
        state, losses, lr = straight[rank]
        r_state, r_losses, r_lr, extra = resumed[rank]
        assert extra == {"epoch": 3, "rank0_seen": 2}
        assert r_losses == losses, f"rank {rank}: losses after resuming differ"
        assert r_lr == lr
        for k in state:
            assert torch.equal(r_state[k], state[k]), f"rank {rank} stage {stage}: {k} differs after resuming"


def test_resume_in_bf16_at_the_same_world_size_and_stage(tmp_path):
    path = str(tmp_path / "ckpt")
    straight = run_ranks(_save_then_continue, 2, 3, "bf16", path)
    resumed = run_ranks(_resume, 2, 3, "bf16", path)
    for rank in range(2):
        assert resumed[rank][1] == straight[rank][1]
        for k, v in straight[rank][0].items():
            assert torch.equal(resumed[rank][0][k], v), k


def _resume_without_dropout_rng(rank, world, stage, dtype, path):
    """Resuming at another world size: ranks' dropout masks cannot match the
    saving run's, so the model runs in eval mode on both sides."""
    engine, scheduler = _engine(stage, dtype, seed=1)
    engine.module.eval()
    engine.load(path, lr_scheduler=scheduler)
    _train(engine, scheduler, rank, world, range(2, 4))
    return engine.full_state_dict()


def _save_then_continue_eval(rank, world, stage, dtype, path):
    engine, scheduler = _engine(stage, dtype)
    engine.module.eval()
    _train(engine, scheduler, rank, world, range(2))
    engine.save(path, lr_scheduler=scheduler)
    _train(engine, scheduler, rank, world, range(2, 4))
    return engine.full_state_dict()


@pytest.mark.parametrize("saved,resumed", [((2, 3), (4, 1)), ((4, 0), (2, 3)), ((2, 2), (4, 3))])
def test_resume_at_another_world_size_and_stage(saved, resumed, tmp_path):
    path = str(tmp_path / "ckpt")
    straight = run_ranks(_save_then_continue_eval, saved[0], saved[1], "fp32", path)[0]
    for rank, state in enumerate(run_ranks(_resume_without_dropout_rng, resumed[0], resumed[1], "fp32", path)):
        assert_state_close(state, straight, rtol=1e-5, atol=1e-6, what=f"rank {rank} {saved} -> {resumed}")


def _bf16_resume_reference():
    """What resuming _save_then_continue_eval's checkpoint in bf16 on 2 ranks
    should give: torch's fp32 run up to the save, then the mixed-precision
    reference from there, with the same optimizer state and lr schedule.
    Returns (the params at the save, at the end)."""
    model = make(DropoutLM).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    reference_train(model, opt, 2, 2, 4, scheduler=scheduler)  # _train's global batches: lm_batch(..., world=4)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    end, _ = mp_reference_train(model, opt, torch.bfloat16, 2, 2, 2, batch=lambda s, m, w: lm_batch(s + 2, m, 4),
                                lr_scheduler=scheduler)
    return saved, end


def test_resume_at_another_training_dtype(tmp_path):
    """An fp32 checkpoint resumed in bf16, on every rank: within 2% of how
    far the 2 steps after the save move each param (measured: 0.1%). A
    resume that lost the Adam moments is off by up to 130% of it, one that
    lost the lr schedule by 140%, one that never stepped by 100%."""
    path = str(tmp_path / "ckpt")
    run_ranks(_save_then_continue_eval, 2, 3, "fp32", path)
    saved, ref = _bf16_resume_reference()
    for rank, state in enumerate(run_ranks(_resume_without_dropout_rng, 2, 1, "bf16", path)):
        assert_moved_like(state, ref, saved, 0.02, what=f"fp32 -> bf16, rank {rank}")


# Broken checkpoints ------------------------------------------------------------
def _saved(rank, world, path, layers=2):
    engine, scheduler = _engine(3, layers=layers)
    _train(engine, scheduler, rank, world, range(2))
    engine.save(path, lr_scheduler=scheduler)


def _load_expecting_error(rank, world, path):
    engine, scheduler = _engine(3, seed=1)
    _train(engine, scheduler, rank, world, range(1))
    before = engine.full_state_dict()
    step, lr = engine.step_count, engine.optimizer.param_groups[0]["lr"]
    try:
        engine.load(path, lr_scheduler=scheduler)
    except zerocore.CheckpointError as e:
        after = engine.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "the engine changed"
        assert (engine.step_count, engine.optimizer.param_groups[0]["lr"]) == (step, lr)
        _train(engine, scheduler, rank, world, range(1, 2))  # and trains on
        return str(e)
    raise AssertionError("engine.load accepted a broken checkpoint")


def _rank_file(path, rank):
    folder = next(e for e in os.listdir(path) if e != "zerocore.json")
    return os.path.join(path, folder, f"rank-{rank:05d}-of-00002.safetensors")


def _flip_a_byte(path):
    """One bit of one param's stretch in rank 1's file, which only rank 1 reads."""
    f = _rank_file(path, 1)
    reader = zerocore.io.safetensors_file.Reader(f)
    key = next(k for k in reader.entries if k.startswith("param/blocks.1"))
    where = reader._data_start + reader.entries[key][2] + 2
    reader.close()
    with open(f, "r+b") as fh:
        fh.seek(where)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x10]))
    return "rank-00001-of-00002.safetensors: checksum mismatch"


def _truncate(path):
    f = _rank_file(path, 0)
    os.truncate(f, os.path.getsize(f) - 100)
    return "rank-00000-of-00002.safetensors: .* bytes, the manifest says"


def _delete(path):
    os.remove(_rank_file(path, 1))
    return "rank-00001-of-00002.safetensors: missing"


def _edit_manifest(path):
    f = os.path.join(path, "zerocore.json")
    with open(f) as fh:
        text = fh.read()
    with open(f, "w") as fh:
        fh.write(text.replace('"step": 2', '"step": 3'))
    return "zerocore.json: checksum mismatch"


def _no_checkpoint(path):
    shutil.rmtree(path)
    return "no checkpoint there"


@pytest.mark.parametrize("breaks", [_flip_a_byte, _truncate, _delete, _edit_manifest, _no_checkpoint])
def test_broken_checkpoint_fails_on_every_rank_with_the_engine_unchanged(breaks, tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_saved, 2, path)
    expected = breaks(path)
    for message in run_ranks(_load_expecting_error, 2, path):
        assert re.search(expected, message), message


def test_checkpoint_of_another_model_or_save_is_refused(tmp_path):
    other = str(tmp_path / "other")
    run_ranks(_saved, 2, other, 3)  # three blocks
    for message in run_ranks(_load_expecting_error, 2, other):
        assert "another model" in message and "blocks.2" in message
    path, second = str(tmp_path / "ckpt"), str(tmp_path / "second")
    run_ranks(_saved, 2, path)
    run_ranks(_saved, 2, second)
    shutil.copy(_rank_file(second, 1), _rank_file(path, 1))
    for message in run_ranks(_load_expecting_error, 2, path):
        assert "belongs to save" in message and "different checkpoints mixed" in message


# Saves that fail or die --------------------------------------------------------
def _save_failing_on_rank_1(rank, world, path):
    engine, scheduler = _engine(3, seed=1)
    _train(engine, scheduler, rank, world, range(1))
    if rank == 1:
        zerocore.io.save_load.write_rank_file = _disk_full
    try:
        engine.save(path)
    except zerocore.CheckpointError as e:
        return str(e)
    raise AssertionError("the save did not fail")


def _disk_full(*args):
    raise OSError(28, "No space left on device")


def _load_state(rank, world, path):
    engine, scheduler = _engine(3, seed=1)
    engine.load(path, lr_scheduler=scheduler)
    return engine.full_state_dict(), engine.step_count


def _fresh_state(rank, world, path):
    engine, scheduler = _engine(3)
    _train(engine, scheduler, rank, world, range(2))
    return engine.full_state_dict()


def test_a_save_failing_on_one_rank_fails_everywhere_and_keeps_the_last(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_saved, 2, path)
    for message in run_ranks(_save_failing_on_rank_1, 2, path):
        assert "rank 1: OSError" in message and "No space left" in message and "unchanged" in message
    assert sorted(os.listdir(path))[-1] == "zerocore.json" and len(os.listdir(path)) == 2  # no stray folder
    expected = run_ranks(_fresh_state, 2, path)[0]
    state, step = run_ranks(_load_state, 2, path)[0]
    assert step == 2 and all(torch.equal(state[k], v) for k, v in expected.items())


def _killed_save(path, point):
    """A single-process engine that saves once, then dies in a second save
    at `point`: while writing its rank file, or just before the commit."""
    torch.set_num_threads(1)  # a forked child must not use the parent's OpenMP pool
    engine, scheduler = _engine(0)
    _train(engine, scheduler, 0, 1, range(2))
    engine.save(path)
    _train(engine, scheduler, 0, 1, range(2, 3))
    if point == "rank file":
        real = zerocore.io.safetensors_file.write

        def dying(path, entries, *args, **kwargs):  # the second half of the tensors never comes
            die = (lambda: os.kill(os.getpid(), signal.SIGKILL))
            real(path, [e if i < len(entries) // 2 else (*e[:3], die) for i, e in enumerate(entries)], *args, **kwargs)

        zerocore.io.safetensors_file.write = dying
    else:
        os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    engine.save(path)


def _single_process_state(path=None):
    engine, scheduler = _engine(0, seed=1)
    if path:
        engine.load(path)
    else:
        engine, scheduler = _engine(0)
        _train(engine, scheduler, 0, 1, range(2))
    return engine.full_state_dict()


@pytest.mark.parametrize("point", ["rank file", "commit"])
def test_a_save_killed_halfway_leaves_the_previous_checkpoint(point, tmp_path):
    path = str(tmp_path / "ckpt")
    child = multiprocessing.get_context("fork").Process(target=_killed_save, args=(path, point))
    child.start()
    child.join(60)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == -signal.SIGKILL
    folders = [e for e in os.listdir(path) if os.path.isdir(os.path.join(path, e))]
    assert len(folders) == 2  # the committed save's and the dead one's
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same arithmetic as the child's
    try:
        got, expected = _single_process_state(path), _single_process_state()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_save_refuses_pending_gradients_and_non_json_extra(tmp_path):
    engine, _ = _engine(0)
    x, y = lm_batch(0, 0, 1)
    engine.backward(lm_loss(engine(x), y))
    with pytest.raises(zerocore.CheckpointError, match="backward pass.*after engine.step"):
        engine.save(tmp_path / "a")
    engine.step()
    with pytest.raises(zerocore.CheckpointError, match="extra is not JSON-serialisable"):
        engine.save(tmp_path / "a", extra={"f": object()})
    assert not os.path.exists(tmp_path / "a")


# Export ------------------------------------------------------------------------
def _save_and_report(rank, world, path):
    engine, scheduler = _engine(3)
    _train(engine, scheduler, rank, world, range(2))
    engine.save(path)
    return engine.full_state_dict()


def test_export_loads_into_a_plain_model(tmp_path):
    from safetensors.torch import load_file

    path, out = str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")
    full = run_ranks(_save_and_report, 2, path)[0]
    run = subprocess.run([sys.executable, "-m", "zerocore", "export", path, out], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    exported = load_file(out)  # the safetensors package's own reader
    assert set(exported) == set(full) and "head.weight" in exported and "embed.weight" in exported  # tied: both
    model = DropoutLM()
    model.load_state_dict(exported, strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, full[k]), k


def test_export_of_a_corrupt_checkpoint_says_so_and_writes_nothing(tmp_path):
    path, out = str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")
    run_ranks(_saved, 2, path)
    _flip_a_byte(path)
    run = subprocess.run([sys.executable, "-m", "zerocore", "export", path, out], capture_output=True, text=True)
    assert run.returncode == 1 and "checksum mismatch" in run.stderr
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")


def _fp16_scale_round_trip(rank, world, path):
    engine, scheduler = _engine(2, "fp16")
    _train(engine, scheduler, rank, world, range(1))
    # As after overflows and clean steps.
    engine.scaler.load_state_dict({"scale": 2.0**10, "clean_steps": 7, "hysteresis": 1})
    engine.save(path)
    resumed, _ = _engine(2, "fp16", seed=1)
    resumed.load(path)
    return (resumed.loss_scale, resumed.scaler.state_dict()["clean_steps"], resumed.step_count), engine.step_count


def test_the_loss_scale_and_its_clean_steps_come_back(tmp_path):
    for result, steps_taken in run_ranks(_fp16_scale_round_trip, 2, str(tmp_path / "ckpt")):
        assert result == (2.0**10, 7, steps_taken)
