"""DeepSpeed JSON configs (zerocore.DeepSpeedConfig, Config.from_deepspeed):
every key of DeepSpeed's documented schema that zerocore reads maps onto
what it names; a run configured from JSON equals the same run configured by
hand; where semantics could drift (batch-size resolution, loss scaling, the
schedulers' learning rates) zerocore is compared with DeepSpeed itself, on
its CPU accelerator; and a config trains as deepspeed.initialize's engine
trains it on 2 gloo ranks."""
import json
import math
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import zerocore
from zerocore import Config, DeepSpeedConfig, DeepSpeedConfigError, DynamicLossScale
from zerocore.integrations.deepspeed.schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR
from zerocore.ops.loss_scale import LossScaler, NonFiniteGradientError
import readme
from dist_harness import run_ranks
from models import assert_state_close, engine_train, make

os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Every key zerocore reads, as DeepSpeed's documentation spells them.
FULL = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "communication_data_type": "fp32",
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                                      "warmup_num_steps": 100, "total_num_steps": 1000,
                                                      "warmup_type": "linear"}},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
             "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 2},
    "bf16": {"enabled": False},
    "zero_optimization": {
        "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 1000,
        "stage3_prefetch_bucket_size": 3000, "stage3_param_persistence_threshold": 50,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True, "sub_group_size": 1e9,
    },
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
}


def test_every_key_maps_onto_what_it_names(tmp_path):
    with pytest.warns(UserWarning, match="change nothing") as record:
        ds = DeepSpeedConfig(FULL, world_size=2)
    assert len(record) == 1  # every key that changes nothing, in one warning
    ignored = str(record[0].message)
    for key in ("steps_per_print", "wall_clock_breakdown", "zero_optimization.overlap_comm",
                "zero_optimization.offload_param.pin_memory", "zero_optimization.sub_group_size"):
        assert key in ignored
    assert (ds.train_batch_size, ds.micro_batch_size, ds.gradient_accumulation_steps) == (32, 4, 4)
    c = ds.config
    assert (c.stage, c.dtype, c.reduce_dtype, c.max_grad_norm) == (3, "fp16", "fp32", 1.0)
    assert c.loss_scale == DynamicLossScale(initial=2.0**12, window=500, hysteresis=3, min_scale=2.0,
                                            consecutive_hysteresis=True, deepspeed_growth=True)
    # fp32 reduce, fp16 params; DeepSpeed keeps params of at most 50 elements whole, zerocore those of fewer than 51
    assert (c.bucket_bytes, c.prefetch_bytes, c.persist_threshold) == (4000, 6000, 51)
    assert (c.offload_optimizer, c.offload_params) == ("cpu", "cpu")
    (tmp_path / "ds_config.json").write_text(json.dumps(FULL))
    for source in (FULL, tmp_path / "ds_config.json", str(tmp_path / "ds_config.json")):  # a dict or a JSON file
        with pytest.warns(UserWarning, match="change nothing"):
            assert zerocore.Config.from_deepspeed(source, world_size=2) == c
    opt = ds.optimizer([torch.nn.Parameter(torch.zeros(3))])
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.9, 0.95), 1e-8, 0.1)
    assert isinstance(ds.scheduler(opt), WarmupDecayLR)


@pytest.mark.parametrize("kind,decoupled,weight_decay", [
    ({"type": "Adam", "params": {"lr": 1e-3}}, True, 0.0),  # DeepSpeed's Adam is AdamW unless told
    ({"type": "adam", "params": {"lr": 1e-3, "adam_w_mode": False, "weight_decay": 0.1}}, False, 0.1),
    ({"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, True, 0.01),  # torch's default decay
])
def test_adam_types_keep_deepspeeds_semantics(kind, decoupled, weight_decay):
    opt = DeepSpeedConfig({"train_batch_size": 2, "optimizer": kind}).optimizer([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.AdamW) == decoupled and opt.param_groups[0]["weight_decay"] == weight_decay


@pytest.mark.parametrize("change,match", [
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}}, "NVMe"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}}, "quantized gradients"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}, "partial offload"),
    ({"zero_optimization": {"stage": 2, "some_new_knob": 1}}, "zero_optimization.some_new_knob"),
    ({"curriculum_learning": {"enabled": True}}, "'curriculum_learning' would change training"),
    ({"amp": {"enabled": True}}, "'amp' would change training"),
    ({"prescale_gradients": True}, "'prescale_gradients'"),
    ({"gradient_clipping": "auto"}, "sets gradient_clipping to \"auto\""),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both fp16 and bf16"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast"),
    ({"train_micro_batch_size_per_gpu": 3}, "disagree"),
    ({"train_batch_size": None}, "neither train_batch_size"),
    ({"zero_optimization": {"stage": 5}}, "stage=5"),
])
def test_what_zerocore_does_not_do_is_an_error_naming_it(change, match):
    config = {"train_batch_size": 8, "gradient_accumulation_steps": 2, **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(DeepSpeedConfigError, match=match):
        DeepSpeedConfig(config, world_size=2)


@pytest.mark.parametrize("block,match", [
    ({"optimizer": {"type": "Lamb", "params": {}}}, "Lamb"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, "gradient_clipping"),
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}}, "bias_correction"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "OneCycle"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "total_num_steps"),
])
def test_optimizer_and_scheduler_blocks_zerocore_cannot_build_are_errors(block, match):
    ds = DeepSpeedConfig({"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **block})
    with pytest.raises(DeepSpeedConfigError, match=match):
        ds.scheduler(ds.optimizer([torch.nn.Parameter(torch.zeros(2))]))


# A run from JSON against the same run by hand ---------------------------------

POWER = 15  # high enough for the first steps to overflow in fp16, so that hysteresis and growth both act
RUN = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
       "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.1}},
       "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2}},
       "fp16": {"enabled": True, "initial_scale_power": POWER, "loss_scale_window": 2, "hysteresis": 2,
                "consecutive_hysteresis": True, "min_loss_scale": 2},
       "zero_optimization": {"stage": 2, "reduce_bucket_size": 300}}


def _fp16_by_hand(model):
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    return opt, WarmupCosineLR(opt, total_num_steps=6, warmup_num_steps=2), zerocore.Config(
        stage=2, dtype="fp16", bucket_bytes=600, max_grad_norm=0.05,
        loss_scale=DynamicLossScale(initial=2.0**POWER, window=2, hysteresis=2, consecutive_hysteresis=True,
                                    min_scale=2.0, deepspeed_growth=True))


OFFLOADED = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
             "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "nesterov": True}},
             "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 8, "warmup_num_steps": 3,
                                                               "warmup_max_lr": 0.05, "warmup_type": "linear"}},
             "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 100,
                                   "stage3_param_persistence_threshold": 40,
                                   "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}


def _offloaded_by_hand(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    return opt, WarmupDecayLR(opt, total_num_steps=8, warmup_num_steps=3, warmup_max_lr=0.05,
                              warmup_type="linear"), zerocore.Config(
        stage=3, dtype="bf16", prefetch_bytes=200, persist_threshold=41, offload_optimizer="cpu",
        offload_params="cpu")


PLAIN = {"train_micro_batch_size_per_gpu": 2, "communication_data_type": "fp32",
         "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False, "weight_decay": 0.01}},
         "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
         "zero_optimization": {"stage": 1, "reduce_bucket_size": 100, "overlap_comm": True}}


def _plain_by_hand(model):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=0.01)
    return opt, WarmupLR(opt, warmup_num_steps=4), zerocore.Config(stage=1, reduce_dtype="fp32", bucket_bytes=400)


FIXED_SCALE = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
               "fp16": {"enabled": True, "loss_scale": 256},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
               "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_type": "linear"}},
               "zero_optimization": {"stage": 2, "contiguous_gradients": True,
                                     "offload_optimizer": {"device": "cpu", "pin_memory": True}}}


def _fixed_scale_by_hand(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # torch_adam: torch's defaults
    return opt, WarmupLR(opt, warmup_num_steps=3, warmup_type="linear"), zerocore.Config(
        stage=2, dtype="fp16", loss_scale=256.0, offload_optimizer="cpu")


RUNS = {"stage 2, fp16": (RUN, _fp16_by_hand), "stage 3 offloaded, bf16": (OFFLOADED, _offloaded_by_hand),
        "stage 1, fp32": (PLAIN, _plain_by_hand), "stage 2 offloaded, fp16 fixed scale": (FIXED_SCALE,
                                                                                           _fixed_scale_by_hand)}


def _from_json_and_by_hand(rank, world, case):
    source, by_hand = RUNS[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the keys that change nothing
        ds = DeepSpeedConfig(source)
    def from_json(model):
        opt = ds.optimizer(model.parameters())
        return opt, ds.scheduler(opt), ds.config

    out = []
    for build in (from_json, by_hand):
        model = make()
        opt, scheduler, config = build(model)
        engine = zerocore.wrap(model, opt, config)
        state = engine_train(engine, rank, world, 8, ds.gradient_accumulation_steps, scheduler=scheduler)
        out.append((state, engine.loss_scale, engine.step_count))
    return out, ds.micro_batch_size


def _whole(rank, world, threshold):
    """The params a stage-3 engine keeps whole for DeepSpeed's threshold."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = Config.from_deepspeed({"train_batch_size": world,
                                        "zero_optimization": {"stage": 3,
                                                              "stage3_param_persistence_threshold": threshold}})
    model = torch.nn.Sequential(torch.nn.Linear(10, 5), torch.nn.Linear(5, 3))
    engine = zerocore.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    whole = sorted(name for g in engine.groups if not g.sharded for names in g.names for name in names)
    engine.close()
    return whole


@pytest.mark.parametrize("threshold", [0, 4, 5, 15, 49, 50])
def test_persistence_threshold_keeps_whole_what_deepspeed_keeps_whole(threshold):
    """DeepSpeed keeps a param whole when it has at most
    stage3_param_persistence_threshold elements (partition_parameters.py:
    ds_numel <= threshold), none at 0; the params here have 50, 5, 15 and 3."""
    model = torch.nn.Sequential(torch.nn.Linear(10, 5), torch.nn.Linear(5, 3))
    expected = sorted(n for n, p in model.named_parameters() if p.numel() <= threshold)
    for whole in run_ranks(_whole, 2, threshold):
        assert whole == expected


@pytest.mark.parametrize("case", RUNS)
def test_a_run_from_json_equals_the_run_configured_by_hand(case):
    for ((from_json, scale, steps), (by_hand, hand_scale, hand_steps)), micro in \
            run_ranks(_from_json_and_by_hand, 2, case):
        assert micro == 2
        assert (scale, steps) == (hand_scale, hand_steps)
        if case == "stage 2, fp16":
            assert 0 < steps < 8, "some steps overflowed and some were applied"
        if case.endswith("fixed scale"):
            assert (scale, steps) == (256, 8)  # no step overflowed
        assert_state_close(from_json, by_hand, rtol=0, atol=0, what=f"{case}: from JSON")


# Against DeepSpeed itself --------------------------------------------------------

@pytest.fixture
def deepspeed(monkeypatch):
    ds = pytest.importorskip("deepspeed")
    import deepspeed.runtime.config as ds_config
    import deepspeed.runtime.fp16.loss_scaler as ds_scaler

    # Outside deepspeed.init_distributed, DeepSpeed asks its comm layer for
    # this process's rank; these tests, in one process, give it one (and
    # take it back after, for the ranks of test_trains_as_deepspeed).
    for module in (ds_config, ds_scaler):
        monkeypatch.setattr(module.dist, "get_rank", lambda *a, **k: 0)
    return ds


class _DataParallel:
    def __init__(self, world):
        self.world = world

    def get_data_parallel_world_size(self):
        return self.world


@pytest.mark.parametrize("world", [1, 2, 4])
def test_batch_keys_resolve_as_deepspeeds(deepspeed, world):
    from deepspeed.runtime.config import DeepSpeedConfig as Reference

    for train in (None, 16, 24):
        for micro in (None, 2, 3):
            for accum in (None, 1, 2):
                given = {k: v for k, v in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                                           ("gradient_accumulation_steps", accum)) if v is not None}
                try:
                    ref = Reference(dict(given), mpu=_DataParallel(world))
                    expected = (ref.train_batch_size, ref.train_micro_batch_size_per_gpu,
                                ref.gradient_accumulation_steps)
                except (AssertionError, ValueError):
                    expected = None
                try:
                    ours = DeepSpeedConfig(given, world_size=world)
                    got = (ours.train_batch_size, ours.micro_batch_size, ours.gradient_accumulation_steps)
                except DeepSpeedConfigError:
                    got = None
                assert got == expected, (given, world)


@pytest.mark.parametrize("fp16", [
    {"initial_scale_power": 10, "loss_scale_window": 3, "hysteresis": 1, "min_loss_scale": 4},
    {"initial_scale_power": 10, "loss_scale_window": 3, "hysteresis": 2, "min_loss_scale": 4},
    {"initial_scale_power": 10, "loss_scale_window": 3, "hysteresis": 3, "consecutive_hysteresis": True,
     "min_loss_scale": 4},
    {},  # DeepSpeed's defaults
    {"loss_scale": 128},  # a fixed scale
], ids=["hysteresis 1", "hysteresis 2", "consecutive hysteresis 3", "defaults", "fixed scale"])
def test_loss_scale_follows_deepspeeds_step_by_step(deepspeed, fp16, gen):
    """The same fp16 block, read by DeepSpeed (its config parser and the
    loss scaler its engine makes from it) and by zerocore: the same scale
    after every step of random overflows, and, with dynamic scaling, an
    error at the same step once the scale is at its minimum."""
    from deepspeed.runtime.config import DeepSpeedConfig as Reference
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler

    config = {"train_batch_size": 1, "fp16": {"enabled": True, **fp16}}
    parsed = Reference(json.loads(json.dumps(config)), mpu=_DataParallel(1)).float16_config
    dynamic = parsed.loss_scale == 0  # as DeepSpeedEngine.dynamic_loss_scale decides
    ref = CreateLossScaler(torch.half, parsed.loss_scale, dynamic, parsed.dynamic_loss_scale_args())
    ours = LossScaler(DeepSpeedConfig(config).config.loss_scale, "fp16")
    assert ours.dynamic == dynamic
    # Random outcomes, then overflows until both reach the minimum scale: the
    # random part can grow the scale by up to 2**(200 / window), and each
    # halving back takes up to `hysteresis` overflows, so 400 always reach it.
    overflows = (torch.rand(200, generator=gen) < 0.3).tolist() + [True] * 400
    raised = []
    for step, overflow in enumerate(overflows):
        assert ours.scale == ref.cur_scale, f"step {step}"
        for scaler, update in ((ours, ours.update), (ref, ref.update_scale)):
            try:
                update(overflow)
            except (NonFiniteGradientError, Exception) as e:  # noqa: PERF203 - DeepSpeed raises a bare Exception
                raised.append((scaler is ours, step, "minimum" in str(e)))
        if raised:
            break
    if dynamic:  # both reach the minimum scale and raise there, at the same step
        assert sorted(raised) == [(False, raised[0][1], True), (True, raised[0][1], True)]
    else:
        assert raised == [] and ours.scale == 128


SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_num_steps": 7, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 25, "warmup_min_lr": 0, "warmup_max_lr": 2e-3, "warmup_num_steps": 5}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 8, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 6, "warmup_min_ratio": 0.1,
                        "cos_min_ratio": 0.01}),
    ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_type": "linear"}),
]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # no optimizer steps here
@pytest.mark.parametrize("kind,params", SCHEDULES)
def test_schedulers_give_deepspeeds_learning_rates_step_by_step(deepspeed, kind, params):
    from deepspeed.runtime import lr_schedules

    def optimizer():
        return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 1e-3},
                                {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 5e-4}], lr=1e-3)

    ours_opt, ref_opt = optimizer(), optimizer()
    ours = DeepSpeedConfig({"train_batch_size": 1, "scheduler": {"type": kind, "params": params}}).scheduler(ours_opt)
    ref = getattr(lr_schedules, kind)(ref_opt, **params)
    for step in range(40):
        got, expected = [g["lr"] for g in ours_opt.param_groups], [g["lr"] for g in ref_opt.param_groups]
        assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15) for a, b in zip(got, expected)), (step, got,
                                                                                                      expected)
        ours.step()
        ref.step()


# The same JSON config trained by deepspeed.initialize's engine on 2 gloo
# ranks (its CPU accelerator) and by zerocore: accumulation, clipping that
# bites, torch's AdamW with weight decay and WarmupDecayLR's rates.
TRAIN = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.1,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}},
         "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2,
                                                           "warmup_max_lr": 1e-2}},
         "zero_optimization": {"reduce_bucket_size": 500}}


def _zerocore_and_deepspeed(rank, world, stage):
    import deepspeed as ds_runtime

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    # DeepSpeed's CPU accelerator compiles its shared-memory all-reduce when
    # its comm backend starts, a minute of C++ on a machine without its
    # build cache (CI's); only inference_all_reduce uses it, never training.
    ds_runtime.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    config = {**TRAIN, "zero_optimization": {**TRAIN["zero_optimization"], "stage": stage}}
    out = {}
    for who in ("zerocore", "deepspeed"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        samples = torch.Generator().manual_seed(1 + rank)
        if who == "deepspeed":
            engine, opt, _, scheduler = ds_runtime.initialize(model=model, model_parameters=model.parameters(),
                                                              config=json.loads(json.dumps(config)))
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ds = DeepSpeedConfig(config)
            opt = ds.optimizer(model.parameters())
            scheduler = ds.scheduler(opt)
            engine = zerocore.wrap(model, opt, ds.config)
        rates, norms = [], []
        for micro in range(12):
            x = torch.randn(2, 8, generator=samples)
            loss = torch.nn.functional.mse_loss(engine(x), x[:, :4].sin())
            if who == "deepspeed":  # its engine divides by the accumulation steps and steps on the boundary
                engine.backward(loss)
                engine.step()
                if (micro + 1) % config["gradient_accumulation_steps"] == 0:
                    norms.append(float(engine.get_global_grad_norm()))
            else:
                engine.backward(loss / ds.gradient_accumulation_steps)
                if (micro + 1) % ds.gradient_accumulation_steps == 0:
                    if engine.step():
                        scheduler.step()
                    engine.zero_grad()
            rates.append(opt.param_groups[0]["lr"])
        if who == "deepspeed":
            with ds_runtime.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):
                state = {n: p.detach().clone() for n, p in model.named_parameters()}
        else:
            state = engine.full_state_dict()
            engine.close()
        out[who] = state, rates, norms
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_trains_as_deepspeed(stage):
    pytest.importorskip("deepspeed")
    for ranks in run_ranks(_zerocore_and_deepspeed, 2, stage, timeout=300):
        (ours, our_rates, _), (theirs, their_rates, their_norms) = ranks["zerocore"], ranks["deepspeed"]
        assert our_rates == their_rates
        assert len(their_norms) == 6 and max(their_norms) > TRAIN["gradient_clipping"]  # the clipping bites
        assert_state_close(ours, theirs, rtol=1e-5, atol=1e-7, what=f"stage {stage} against DeepSpeed")


def test_loss_scale_settings_round_trip_through_a_checkpoint(tmp_path):
    """The hysteresis left is part of the loss scale's state."""
    scaler = LossScaler(DynamicLossScale(hysteresis=3), "fp16")
    scaler.update(True)
    again = LossScaler(DynamicLossScale(hysteresis=3), "fp16")
    again.load_state_dict(scaler.state_dict())
    for s in (scaler, again):
        s.update(True)
    assert scaler.state_dict() == again.state_dict() and scaler.scale == 2.0**16
    scaler.update(True)
    assert scaler.scale == 2.0**15


def test_the_docs_example_runs_as_written(tmp_path):
    """docs/deepspeed.md's example, as written: its shell block (the
    config, then torchrun on 2 ranks) with its Python block as train.py."""
    text = readme.section("DeepSpeed configs", "docs/deepspeed.md")
    [shell], [script] = readme.blocks(text, "bash"), readme.blocks(text, "python")
    (tmp_path / "train.py").write_text(script)
    out = readme.run_shell(shell, tmp_path)
    # 8 micro-batches, 2 a step; WarmupLR's first two steps at its start, 0 (DeepSpeed's count from -1).
    steps = re.findall(r"^step (\d): loss [\d.]+, lr (\S+)$", out, re.M)
    assert steps == [("1", "0.00e+00"), ("2", "1.00e-02"), ("3", "1.00e-02"), ("4", "1.00e-02")], out


def test_auto_is_resolved_where_it_changes_no_result():
    """"auto" (which the Hugging Face integration fills in) counts as not
    given for the batch keys, resolved as DeepSpeed resolves them, and as
    zerocore's own default for the sizes that change no result."""
    with pytest.warns(UserWarning, match="overlap_comm"):
        ds = DeepSpeedConfig({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 3,
                              "gradient_accumulation_steps": "auto",
                              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "overlap_comm": "auto",
                                                    "stage3_prefetch_bucket_size": "auto",
                                                    "stage3_param_persistence_threshold": "auto"}}, world_size=2)
    assert (ds.train_batch_size, ds.micro_batch_size, ds.gradient_accumulation_steps) == (6, 3, 1)
    assert ds.config == zerocore.Config(stage=3)


# The Hugging Face docs' DeepSpeed config, "auto" wherever the Trainer fills a value.
HF_DOCS = {"fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16}, "bf16": {"enabled": "auto"},
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                     "weight_decay": "auto"}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                        "warmup_num_steps": "auto"}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none", "pin_memory": "auto"},
                                 "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto",
                                 "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                                 "stage3_gather_16bit_weights_on_model_save": True},
           "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
           "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}


def test_every_unresolved_auto_is_named_in_one_error():
    """Outside the Trainer, every "auto" that needs a value is listed at
    once; those zerocore resolves (batch keys, ZeRO sizes, ignored knobs)
    are not."""
    with pytest.raises(DeepSpeedConfigError) as error:
        zerocore.Config.from_deepspeed(HF_DOCS)
    named = re.search(r"sets (.*) to \"auto\"", str(error.value)).group(1).split(", ")
    assert named == ["fp16.enabled", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas",
                     "optimizer.params.eps", "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
                     "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps", "gradient_clipping"]
    assert "ZeroTrainer" in str(error.value) and "give their values" in str(error.value)


def test_zerocore_needs_neither_deepspeed_nor_transformers(tmp_path):
    """DeepSpeed is a test dependency only and transformers an optional
    extra (zerocore[hf]): with neither importable, zerocore imports, reads a
    DeepSpeed config with its blocks, and estimates a Hugging Face
    config.json."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 768, "n_layer": 12,
                                                      "n_head": 12, "n_positions": 1024, "vocab_size": 50257}))
    script = f"""
import sys
sys.modules.update(deepspeed=None, transformers=None, accelerate=None)  # importing any of them fails
import torch, warnings, zerocore
warnings.simplefilter("ignore")
ds = zerocore.DeepSpeedConfig({FULL!r}, world_size=2)
ds.scheduler(ds.optimizer([torch.nn.Parameter(torch.zeros(2))]))
print(ds.config.stage, zerocore.estimate({str(tmp_path / "config.json")!r}).model.trainable)
"""
    run = subprocess.run([sys.executable, "-c", script], env=readme.environment(), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.split() == ["3", "124439808"], run.stdout + run.stderr
