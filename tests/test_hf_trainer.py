"""zerocore.integrations.hf.ZeroTrainer: a Hugging Face Trainer trained by a
zerocore engine on 2 gloo ranks, against the plain Trainer in one process
with the same global batch (per-device batch twice as large): the same
losses, grad norms, learning rates and final params, with gradient
accumulation and clipping; a run resumed from a save_steps checkpoint goes
on bitwise as the uninterrupted one; save_model's folder loads with
from_pretrained and gives the engine's logits. Tiny GPT-2 (tied embeddings)
and Llama models built from configs, random token ids: nothing downloaded."""
import json
import math
import os
import re

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402

import zerocore  # noqa: E402
import readme  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from zerocore.integrations.hf import CHECKPOINT_DIR, ZeroTrainer  # noqa: E402

WORLD, VOCAB, SEQ = 2, 64, 16


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0))


MODELS = {"gpt2": gpt2, "llama": llama}


def dataset(n=48, seed=1):
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": x, "labels": x} for x in ids]


def arguments(out, batch, **kw):
    return transformers.TrainingArguments(**{
        "output_dir": out, "per_device_train_batch_size": batch, "per_device_eval_batch_size": batch,
        "max_steps": 4, "learning_rate": 3e-3, "weight_decay": 0.1, "logging_steps": 1, "save_strategy": "no",
        "report_to": [], "use_cpu": True, "disable_tqdm": True, "seed": 0, **kw})


class Logs(transformers.TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def steps(logs):
    """(loss, grad_norm, learning_rate) of each logged step."""
    return [(x["loss"], x["grad_norm"], x["learning_rate"]) for x in logs if "loss" in x]


class Recorded:
    """The default collator, recording the samples of each batch it makes."""

    def __init__(self):
        self.batches = []

    def __call__(self, features):
        self.batches.append([f["input_ids"].tolist() for f in features])
        return transformers.default_data_collator(features)


def launched(rank, world):
    """The environment torchrun gives a rank, where accelerate reads the ranks."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")


def plain(name, out, **kw):
    """The plain Trainer in this process, with the global batch of 2 ranks."""
    logs, data = Logs(), Recorded()
    trainer = transformers.Trainer(model=MODELS[name](), args=arguments(out, 2 * 2, **kw), data_collator=data,
                                   train_dataset=dataset(), eval_dataset=dataset(8, seed=2), callbacks=[logs])
    trainer.train()
    return steps(logs.logs), data.batches, trainer.evaluate()["eval_loss"], trainer.model.state_dict()


def _train(rank, world, name, stage, out, kw):
    launched(rank, world)
    logs, data = Logs(), Recorded()
    trainer = ZeroTrainer(model=MODELS[name](), args=arguments(out, 2, **kw), data_collator=data,
                          train_dataset=dataset(), eval_dataset=dataset(8, seed=2), callbacks=[logs],
                          zero_config=zerocore.Config(stage=stage))
    trainer.train()
    return steps(logs.logs), data.batches, trainer.evaluate()["eval_loss"], trainer.engine.full_state_dict()


def assert_close_states(got, want, atol):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=atol, msg=k)


# AdamW (the Trainer's default), whose updates barely depend on the grads'
# scale (and whose few elements with grads near zero take differences in
# the last bits up to a fraction of the rate), with label smoothing (which
# the Trainer shifts for a causal LM, known by its name); and SGD, whose
# updates are the clipped grads times the rate.
@pytest.mark.parametrize("name,stage,optim,atol", [("gpt2", 2, {"label_smoothing_factor": 0.1}, 1e-4),
                                                   ("llama", 3, {"optim": "sgd", "learning_rate": 0.5}, 1e-6)])
def test_trains_as_the_plain_trainer(tmp_path, name, stage, optim, atol):
    """Gradient accumulation 2 and max_grad_norm below the grad norm (so it
    clips): each rank gets its own half of every global batch, and the
    losses, grad norms, learning rates, eval loss and final params are the
    plain Trainer's."""
    kw = {"gradient_accumulation_steps": 2, "max_grad_norm": 0.5, **optim}
    want_steps, want_batches, want_eval, want_state = plain(name, str(tmp_path / "plain"), **kw)
    assert any(norm > 0.5 for _, norm, _ in want_steps)  # the clipping bites
    ranks = run_ranks(_train, WORLD, name, stage, str(tmp_path / "zero"), kw)
    # Micro-batch i of the plain Trainer is micro-batch i of rank 0 followed
    # by rank 1's (4 steps of 2; the loaders collate one ahead, then eval's).
    for i in range(4 * 2):
        assert want_batches[i] == ranks[0][1][i] + ranks[1][1][i]
    for got_steps, _, got_eval, got_state in ranks:
        assert len(got_steps) == len(want_steps) == 4
        torch.testing.assert_close(got_steps, want_steps, rtol=2e-5, atol=0)
        assert got_eval == pytest.approx(want_eval, rel=2e-5)
        assert_close_states(got_state, want_state, atol)


def _resume(rank, world, name, stage, out):
    """A run of 6 steps saving at 3 and 6, its model saved and its logits;
    then runs resumed from checkpoint-3, at the same stage and the other."""
    launched(rank, world)
    kw = {"max_steps": 6, "save_strategy": "steps", "save_steps": 3, "gradient_accumulation_steps": 2}

    def trainer(stage=stage, folder=out):
        logs = Logs()
        return ZeroTrainer(model=MODELS[name](), args=arguments(folder, 2, **kw), train_dataset=dataset(),
                           callbacks=[logs], zero_config=zerocore.Config(stage=stage)), logs

    whole, whole_logs = trainer()
    whole.train()
    whole.save_model(os.path.join(out, "final"))
    ids = torch.stack([x["input_ids"] for x in dataset(3, seed=3)])
    whole.model.eval()
    with torch.no_grad():
        logits = whole.engine(input_ids=ids).logits
    state = whole.engine.full_state_dict()
    checkpoint = os.path.join(out, "checkpoint-3")
    files = sorted(os.listdir(checkpoint))
    resumed, resumed_logs = trainer()
    resumed.train(resume_from_checkpoint=checkpoint)
    other, other_logs = trainer(5 - stage, os.path.join(out, "other"))  # stage 3's checkpoint at stage 2, 2's at 3
    other.train(resume_from_checkpoint=checkpoint)
    return (steps(whole_logs.logs), steps(resumed_logs.logs), state, resumed.engine.full_state_dict(), ids, logits,
            files, steps(other_logs.logs), other.engine.full_state_dict())


@pytest.mark.parametrize("name,stage", [("gpt2", 3), ("llama", 2)])
def test_resumes_bitwise_and_saves_a_model_from_pretrained_loads(tmp_path, name, stage):
    """save_steps checkpoints hold the engine's checkpoint beside the
    Trainer's files; resume_from_checkpoint goes on bitwise; save_model's
    folder (and a checkpoint's) loads with from_pretrained, tied weights
    tied, and gives the engine's logits."""
    out = str(tmp_path)
    for whole, resumed, state, resumed_state, ids, logits, files, other, other_state in \
            run_ranks(_resume, WORLD, name, stage, out):
        # checkpoint-3: the engine's checkpoint beside the Trainer's own files
        # and the consolidated model; no optimizer.pt (the engine's holds it).
        assert {CHECKPOINT_DIR, "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth", "model.safetensors",
                "config.json", "training_args.bin"} <= set(files)
        assert "optimizer.pt" not in files
        assert len(whole) == 6 and resumed == whole[3:]
        assert resumed_state.keys() == state.keys()
        for k in state:
            assert torch.equal(resumed_state[k], state[k]), k
        # Resumed at the other stage: the same state, reductions in another order.
        torch.testing.assert_close(other, whole[3:], rtol=2e-5, atol=0)
        assert_close_states(other_state, state, atol=1e-4)
    for folder in ("final", "checkpoint-6"):
        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, folder))
        loaded = model.state_dict()
        assert loaded.keys() == state.keys()
        for k in state:
            assert torch.equal(loaded[k], state[k]), k
        if name == "gpt2":  # the head is the embedding, tied as Hugging Face ties it
            assert model.lm_head.weight is model.transformer.wte.weight
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, logits)


def _dtypes(rank, world, out):
    launched(rank, world)
    got = {}
    for precision, scale in (("bf16", "dynamic"), ("fp16", zerocore.DynamicLossScale(initial=2.0**17))):
        logs = Logs()
        trainer = ZeroTrainer(model=gpt2(), args=arguments(out, 2, max_steps=4, **{precision: True}),
                              train_dataset=dataset(), callbacks=[logs],
                              zero_config=zerocore.Config(stage=2, loss_scale=scale))
        trainer.train()
        got[precision] = (trainer.engine.config.dtype, trainer.engine.config.reduce_dtype,
                          next(trainer.model.parameters()).dtype, steps(logs.logs), trainer.engine.step_count,
                          trainer.lr_scheduler.last_epoch)
    return got


def test_bf16_and_fp16_arguments_set_the_training_dtype(tmp_path):
    """args.bf16 / args.fp16 train the engine in 16 bits (fp32 masters); an
    fp16 step that overflows is skipped, and so is its scheduler step, as
    the Trainer does for a step its grad scaler skipped."""
    for got in run_ranks(_dtypes, WORLD, str(tmp_path)):
        dtype, reduce_dtype, param_dtype, logged, applied, scheduled = got["bf16"]
        assert (dtype, reduce_dtype, param_dtype) == ("bf16", "bf16", torch.bfloat16)
        assert applied == scheduled == 4 and all(torch.isfinite(torch.tensor(x)).all() for x in logged)
        dtype, reduce_dtype, param_dtype, logged, applied, scheduled = got["fp16"]
        assert (dtype, param_dtype) == ("fp16", torch.float16)
        # Loss scale 2**17 overflows the fp16 grads once it has grown from 2**16.
        assert 0 < applied == scheduled < 4
        assert [math.isinf(norm) for _, norm, _ in logged].count(True) == 4 - applied


def test_a_deepspeed_config_gives_the_zero_part(tmp_path):
    """zero_config=zerocore.DeepSpeedConfig(...): its ZeRO, precision and
    clipping keys set the engine's Config; the Trainer's arguments give the
    batches, the optimizer and the scheduler, so a config that disagrees on
    the batch or brings an optimizer or scheduler block is refused."""
    args = arguments(str(tmp_path), 2, gradient_accumulation_steps=2, bf16=True)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.25,
          "bf16": {"enabled": True}, "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}}
    trainer = ZeroTrainer(model=gpt2(), args=args, zero_config=zerocore.DeepSpeedConfig(ds, world_size=WORLD))
    c = trainer.zero_config
    assert (c.stage, c.max_grad_norm, c.bucket_bytes, c.dtype) == (1, 0.25, 2000, "bf16")
    for bad, match in (({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu is 4"),
                       ({"gradient_accumulation_steps": 1}, "gradient_accumulation_steps is 1"),
                       ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "optimizer or scheduler"),
                       ({"bf16": {"enabled": False}}, "ask for bf16 but zero_config for fp32")):
        with pytest.raises(ValueError, match=match):
            ZeroTrainer(model=gpt2(), args=args, zero_config=zerocore.DeepSpeedConfig({**ds, **bad}, world_size=WORLD))


def test_a_deepspeed_config_with_auto_values_takes_them_from_the_arguments(tmp_path):
    """The Hugging Face docs' DeepSpeed config, as a path or a dict: each
    "auto" takes the TrainingArguments' value (the model's hidden_size for
    the ZeRO sizes), as the Trainer's own DeepSpeed integration fills it.
    Its optimizer and scheduler blocks are refused first, naming why."""
    args = arguments(str(tmp_path), 2, gradient_accumulation_steps=2, bf16=True, max_grad_norm=0.5)
    ds = {"fp16": {"enabled": "auto", "loss_scale": 0}, "bf16": {"enabled": "auto"},
          "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": "auto",
                                "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
          "train_micro_batch_size_per_gpu": "auto"}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    hidden = gpt2().config.hidden_size
    for source in (str(path), ds):
        with pytest.warns(UserWarning, match="overlap_comm"):
            c = ZeroTrainer(model=gpt2(), args=args, zero_config=source).zero_config
        assert (c.stage, c.dtype, c.max_grad_norm) == (3, "bf16", 0.5), c
        assert (c.bucket_bytes, c.prefetch_bytes, c.persist_threshold) == \
            (2 * hidden * hidden, 2 * int(0.9 * hidden * hidden), 10 * hidden + 1), c
    optimizer = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    with pytest.raises(ValueError, match="optimizer or scheduler block"):
        ZeroTrainer(model=gpt2(), args=args, zero_config={**ds, **optimizer})


def _unlaunched(rank, world, out):
    """A process group the Trainer's accelerate does not see (no RANK,
    WORLD_SIZE, LOCAL_RANK in the environment)."""
    with pytest.raises(ValueError, match="2 processes were launched but the Trainer sees 1"):
        ZeroTrainer(model=gpt2(), args=arguments(out, 2))


def test_ranks_the_trainer_would_not_see_are_refused(tmp_path):
    run_ranks(_unlaunched, WORLD, str(tmp_path))


def test_the_docs_example_runs_as_written(tmp_path):
    """docs/hf-trainer.md's example, as written: train.py, launched
    with the torchrun command the page gives."""
    text = readme.section("The Hugging Face Trainer", "docs/hf-trainer.md")
    command = re.search(r"run with `(torchrun [^`]*train\.py)`", text).group(1)
    [script] = readme.blocks(text, "python")
    (tmp_path / "train.py").write_text(script)
    readme.run_shell(command, tmp_path)
    with open(tmp_path / "out" / "checkpoint-4" / "trainer_state.json") as f:
        assert json.load(f)["global_step"] == 4
    assert CHECKPOINT_DIR in os.listdir(tmp_path / "out" / "checkpoint-2")
    model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out" / "final"))
    assert model.config.num_hidden_layers == 2
