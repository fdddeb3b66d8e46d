"""Will it fit? zerocore.estimate, zerocore.largest_model and the zerocore
command (zerocore/sizing/estimate.py): the ZeRO paper's Table 1, engine.memory_report()
of wrapped models, Hugging Face configs, the inverse query, the command line
and the examples of docs/estimate.md as written."""
import json
import math
import random
import re
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch import nn

import zerocore
import readme
from dist_harness import run_ranks
from models import Block, TinyLM
from zerocore.sizing import estimate as sizing
from zerocore.sizing.models import Model, hf_param_count
from zerocore.sizing.quantities import EstimateError, format_bytes, format_count, parse_bytes, parse_count
from zerocore.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("param", "grad", "optim")
P = {"fp32": 4, "bf16": 2, "fp16": 2}


def _rng(gen) -> random.Random:
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    print("seed", seed)  # shown when the test fails
    return random.Random(seed)


# ------------------------------------------------------------------ the formulas


def test_the_paper_table_1_row():
    """Ψ = 7.5B, N = 64, mixed-precision Adam (K = 12): 120, 31.4, 16.6 and 1.88 GB."""
    psi, n, k = 7_500_000_000, 64, 12
    for dtype in ("fp16", "bf16"):
        est = zerocore.estimate(psi, world_size=n, dtype=dtype, optimizer="adam", offload=["none"])
        got = [est.row(n, stage).device_bytes for stage in range(4)]
        assert got == [(2 + 2 + k) * psi, (2 + 2) * psi + k * psi / n, 2 * psi + (2 + k) * psi / n,
                       (2 + 2 + k) * psi / n]
        assert got == [120_000_000_000, 31_406_250_000, 16_640_625_000, 1_875_000_000]
        assert [float(f"{b / 1e9:.3g}") for b in got] == [120, 31.4, 16.6, 1.88]
        assert [format_bytes(b) for b in got] == ["120", "31.4", "16.6", "1.88"]
        assert all(r.host_bytes == 0 for r in est.rows) and len(est.rows) == 4


def _expected(stage, offload, psi, frozen, n, dtype, optimizer, momentum, reduce_dtype, delayed):
    """The bytes per rank written out from docs/formulas.md and
    docs/offload.md's table, independently of zerocore.sizing.accounting."""
    p, r = P[dtype], P[reduce_dtype]
    states = {"adam": 8, "adamw": 8, "sgd": 4 if momentum else 0}[optimizer]
    off_opt, off_params = offload != "none", offload == "params"
    k = states + (4 if dtype != "fp32" or off_opt else 0)
    total = psi + frozen
    dev = {"param": Fraction(p * total) if stage < 3 else Fraction(p * total, n), "grad": 0, "optim": 0}
    host = dict.fromkeys(KEYS, Fraction(0))
    grads = Fraction(r * psi) if stage < 2 else Fraction(r * psi, n)
    optim = Fraction(k * psi) if stage == 0 else Fraction(k * psi, n)
    if not off_opt:
        dev.update(grad=grads, optim=optim)
    else:
        host["optim"] = optim
        if stage == 1:
            dev["grad"], host["grad"] = grads, Fraction(r * psi, n)
        else:
            host["grad"] = grads * (2 if delayed else 1)
        if dtype != "fp32":
            host["param"] = Fraction(p * psi, n)
        if off_params:
            host["param"] += dev["param"]
            dev["param"] = 0
    return dev, host


def test_formula_rows_by_device_and_host(gen):
    rng = _rng(gen)
    for _ in range(60):
        case = dict(psi=rng.randrange(1, 10**11), frozen=rng.choice([0, rng.randrange(1, 10**10)]),
                    n=rng.choice([1, 2, 3, 8, 64, 1000]), dtype=rng.choice(list(P)),
                    optimizer=rng.choice(sizing.OPTIMIZERS), momentum=rng.random() < 0.5,
                    reduce_dtype=rng.choice(list(P)), delayed=rng.random() < 0.5)
        model = Model(case["psi"], case["frozen"])
        est = zerocore.estimate(model, case["n"], case["dtype"], case["optimizer"], momentum=case["momentum"],
                                config={"reduce_dtype": case["reduce_dtype"], "delayed_update": case["delayed"]})
        assert [(r.stage, r.offload) for r in est.rows] == [
            (0, "none"), (1, "none"), (1, "optimizer"), (2, "none"), (2, "optimizer"), (3, "none"),
            (3, "optimizer"), (3, "params")]
        for row in est.rows:
            dev, host = _expected(row.stage, row.offload, **case)
            for k in KEYS:
                assert row.device[k] == pytest.approx(float(dev[k]), rel=1e-12), (case, row)
                assert row.host[k] == pytest.approx(float(host[k]), rel=1e-12), (case, row)


# ------------------------------------------------------------------ a module: the engine's own figures


def tied():
    return TinyLM(layers=3)


def untied_half_frozen():
    model = TinyLM(layers=2, tied=False)
    for p in [*model.embed.parameters(), *model.blocks[0].parameters()]:
        p.requires_grad = False
    return model


def odd_sizes():
    return nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 5), nn.LayerNorm(5), Block(5))


OPTIMIZERS = {"adam": lambda ps, m: torch.optim.Adam(ps), "adamw": lambda ps, m: torch.optim.AdamW(ps),
              "sgd": lambda ps, m: torch.optim.SGD(ps, lr=0.1, momentum=0.9 if m else 0.0)}

# (builder, dtype, optimizer, momentum, Config fields, units)
CASES = {
    2: [(tied, "bf16", "adamw", True, {"bucket_bytes": 1024}, None),
        (untied_half_frozen, "fp32", "sgd", True, {"bucket_bytes": 512, "delayed_update": True}, None),
        (odd_sizes, "fp16", "adam", True, {"persist_threshold": 20}, None),
        (tied, "bf16", "sgd", False, {"reduce_dtype": "fp32", "bucket_bytes": 300}, [Block]),
        # Config(deterministic=True): the exact sums, in the grad partition or beside the grads
        (untied_half_frozen, "fp32", "adamw", True, {"deterministic": True, "bucket_bytes": 512,
                                                     "delayed_update": True}, None)],
    3: [(odd_sizes, "bf16", "adamw", True, {"bucket_bytes": 256}, [nn.Linear]),
        (untied_half_frozen, "fp16", "adamw", True, {}, None),
        (odd_sizes, "bf16", "sgd", True, {"deterministic": True, "persist_threshold": 20}, None)],
}


def _reports(rank, world):
    """memory_report() of every case, stage and offload, wrapped for real."""
    out = []
    for build, dtype, optimizer, momentum, extra, units in CASES[world]:
        for n, stage, offload in sizing._combinations([world], range(4), sizing.OFFLOADS):
            torch.manual_seed(0)
            model = build()
            off_opt, off_params = sizing.OFFLOADS[offload]
            cfg = dict(extra, stage=stage, dtype=dtype, offload_optimizer="cpu" if off_opt else None,
                       offload_params="cpu" if off_params else None,
                       delayed_update=extra.get("delayed_update", False) and off_opt)
            opt = OPTIMIZERS[optimizer]([p for p in model.parameters() if p.requires_grad], momentum)
            engine = zerocore.wrap(model, opt, cfg, units=units)
            out.append(((stage, offload), engine.memory_report()))
            engine.close()
    return out


@pytest.mark.parametrize("world", sorted(CASES))
def test_module_estimate_equals_memory_report(world):
    reports = run_ranks(_reports, world, timeout=240)
    at = 0
    for build, dtype, optimizer, momentum, extra, units in CASES[world]:
        est = zerocore.estimate(build, world, dtype, optimizer, momentum=momentum, config=extra, units=units)
        assert est.layout == "engine"
        for row in est.rows:
            for rank, per_rank in enumerate(reports):
                key, report = per_rank[at]
                assert key == (row.stage, row.offload)
                what = f"{build.__name__} {dtype} {optimizer} {extra} world {world} rank {rank} {key}"
                measured = {where: {k: report["by_device"][where][k] for k in KEYS} for where in ("device", "host")}
                assert measured == {"device": row.device, "host": row.host}, what
                assert {k: report[k] for k in KEYS} == {k: row.total(k) for k in KEYS}, what
            at += 1
    assert at == len(reports[0])


def test_module_estimate_is_the_formula_where_nothing_pads():
    """Params of 64 x 64 elements, in one bucket each, split evenly over 1, 2
    and 4 ranks on 64-byte lines: the layout adds nothing, and the engine's
    buffers (FlatGroup.buffer_plan) and the formulas
    (accounting.memory_coefficients) give the same bytes, frozen params too."""
    def build():
        model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(4)))
        model[1].weight.requires_grad = False
        return model

    for dtype in P:
        for optimizer, momentum in (("adamw", True), ("sgd", True), ("sgd", False)):
            kw = dict(world_size=[1, 2, 4], dtype=dtype, optimizer=optimizer, momentum=momentum,
                      config={"delayed_update": True})
            layout = zerocore.estimate(build, **kw)
            formula = zerocore.estimate(Model(3 * 64 * 64, 64 * 64), **kw)
            assert (layout.model.trainable, layout.model.frozen) == (3 * 64 * 64, 64 * 64)
            assert layout.rows == formula.rows and len(layout.rows) == 24


def test_a_model_built_by_name_on_the_meta_device():
    est = zerocore.estimate("zerocore.examples.train:default_model", 2, stages=[3], offload=["none"])
    assert est.model.module is not None and all(p.device.type == "meta" for p in est.model.module.parameters())
    from zerocore.examples.train import default_model

    assert est.rows == zerocore.estimate(default_model, 2, stages=[3], offload=["none"]).rows
    with pytest.raises(EstimateError, match="has no nothing"):
        zerocore.estimate("zerocore.examples.train:nothing")
    with pytest.raises(EstimateError, match="cannot import"):
        zerocore.estimate("zerocore.no_such_module:build")
    with pytest.raises(EstimateError, match="not a torch.nn.Module"):
        zerocore.estimate(lambda: 3)


# ------------------------------------------------------------------ Hugging Face configs

GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
        "vocab_size": 50257}
LLAMA2_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
             "tie_word_embeddings": False}
MISTRAL_7B = {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}
TINYLLAMA = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
             "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4}


@pytest.mark.parametrize("config,params", [(GPT2, 124_439_808), (LLAMA2_7B, 6_738_415_616),
                                           (MISTRAL_7B, 7_241_732_096), (TINYLLAMA, 1_100_048_384)])
def test_hugging_face_config_param_counts(tmp_path, config, params):
    """The published counts of GPT-2, Llama-2-7B, Mistral-7B and TinyLlama-1.1B."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert hf_param_count(config) == params
    for source in (tmp_path / "config.json", str(tmp_path)):  # the file, or its folder
        est = zerocore.estimate(source, 8, "bf16", "adamw", stages=[3], offload=["none"])
        assert (est.model.trainable, est.model.frozen, est.layout) == (params, 0, "formula")
        assert est.row(8, 3).device_bytes == pytest.approx((2 + 2 + 12) * params / 8, rel=1e-15)


def test_hugging_face_config_variants():
    untied = dict(GPT2, tie_word_embeddings=False)
    assert hf_param_count(untied) == 124_439_808 + 50257 * 768
    tied = dict(LLAMA2_7B, tie_word_embeddings=True)
    assert hf_param_count(tied) == 6_738_415_616 - 32000 * 4096
    biased = dict(TINYLLAMA, attention_bias=True, mlp_bias=True)
    extra_per_layer = (2048 + 2 * 256 + 2048) + (2 * 5632 + 2048)
    assert hf_param_count(biased) == 1_100_048_384 + 22 * extra_per_layer


def test_hugging_face_config_errors(tmp_path):
    with pytest.raises(EstimateError) as e:
        hf_param_count({"model_type": "t5"})
    assert all(name in str(e.value) for name in ("'t5'", "gpt2", "llama", "mistral", "module:function"))
    with pytest.raises(EstimateError, match="has no 'hidden_size'"):
        hf_param_count({"model_type": "llama", "vocab_size": 10})
    with pytest.raises(EstimateError, match="cannot read"):
        zerocore.estimate(str(tmp_path / "missing.json"))


def test_hugging_face_counts_match_transformers(gen):
    """Where transformers is installed: random small configs against the
    model it builds on the meta device."""
    transformers = pytest.importorskip("transformers")
    rng = _rng(gen)
    for _ in range(6):
        heads = rng.choice([2, 4])
        common = dict(vocab_size=rng.randint(50, 300), tie_word_embeddings=rng.random() < 0.5)
        llama = dict(hidden_size=8 * heads, intermediate_size=rng.randint(10, 90), num_hidden_layers=rng.randint(1, 3),
                     num_attention_heads=heads, num_key_value_heads=rng.choice([1, heads]), **common)
        for cfg in (transformers.GPT2Config(n_embd=rng.choice([16, 32]), n_layer=rng.randint(1, 3), n_head=2,
                                            n_positions=rng.randint(8, 64), **common),
                    transformers.LlamaConfig(attention_bias=rng.random() < 0.5, mlp_bias=rng.random() < 0.5, **llama),
                    transformers.MistralConfig(**llama)):
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(cfg)
            assert hf_param_count(cfg.to_dict()) == sum(p.numel() for p in model.parameters()), cfg


# ------------------------------------------------------------------ the inverse


def test_largest_model_is_the_inverse(gen):
    rng = _rng(gen)
    for _ in range(80):
        n, dtype = rng.choice([1, 2, 7, 64, 512]), rng.choice(list(P))
        optimizer, momentum = rng.choice(sizing.OPTIMIZERS), rng.random() < 0.5
        stage = rng.randrange(4)
        offload = rng.choice([o for o in sizing.OFFLOADS if (o == "none" or stage >= 1) and
                              (o != "params" or stage == 3)])
        memory, host = rng.randrange(10**6, 10**12), rng.choice([None, rng.randrange(10**6, 10**13)])
        granularity = rng.choice([1, 1000, 10**6])
        kw = dict(dtype=dtype, optimizer=optimizer, momentum=momentum)
        best = zerocore.largest_model(memory, n, stage, offload, host_memory=host, granularity=granularity, **kw)
        case = (memory, host, n, stage, offload, granularity, kw, best)
        if best == math.inf:
            assert offload == "params" and host is None, case
            continue
        assert best % granularity == 0, case
        fits = zerocore.estimate(best, n, stages=[stage], offload=[offload], **kw).rows[0]
        more = zerocore.estimate(best + granularity, n, stages=[stage], offload=[offload], **kw).rows[0]
        assert fits.fits(memory, host) and not more.fits(memory, host), case
        assert fits.device_bytes <= memory and (host is None or fits.host_bytes <= host), case


def test_largest_model_figures():
    # 16 bytes a param in mixed precision: 80 GB hold 5B params at stage 0, 16N bytes... at stage 3
    assert zerocore.largest_model("80GB", 64, stage=0, offload="none") == 5_000_000_000
    assert zerocore.largest_model("80GB", 64, stage=3, offload="none") == 320_000_000_000
    assert zerocore.largest_model("80GB", 64, stage=3, offload="params") == math.inf
    # offloaded, the host bounds it: (2 + 2 + 12 + 2) bytes / 64 a param on the host at stage 3
    assert zerocore.largest_model("80GB", 64, stage=3, offload="params", host_memory="18GB") == 64 * 10**9
    assert zerocore.largest_model(10**9, 1, stage=0, dtype="fp32", optimizer="sgd", momentum=False) == 10**9 // 8
    assert zerocore.largest_model("80GB", 64, stage=3, granularity=10**9) == 320_000_000_000
    with pytest.raises(EstimateError, match="cannot offload"):
        zerocore.largest_model("80GB", 8, stage=0, offload="optimizer")
    with pytest.raises(EstimateError, match="unit"):
        zerocore.largest_model("80", 8)


def test_sizes_and_counts():
    assert [parse_count(x) for x in ("7.5B", "125M", "350k", "1.3e9", "7_500_000", "2T", 12)] == [
        7_500_000_000, 125_000_000, 350_000, 1_300_000_000, 7_500_000, 2 * 10**12, 12]
    assert [parse_bytes(x) for x in ("80GB", "80 GiB", "512MiB", "1.5TB", "4096B", "2kb", 7)] == [
        80 * 10**9, 80 * 2**30, 512 * 2**20, 1_500_000_000_000, 4096, 2000, 7]
    for bad in ("7.5X", "many"):
        with pytest.raises(EstimateError):
            parse_count(bad)
    with pytest.raises(EstimateError, match="unit"):
        parse_bytes("80")
    assert format_count(7_500_000_000) == "7,500,000,000 (7.5B)"


# ------------------------------------------------------------------ the command


def _run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


PAPER_ARGS = ["estimate", "7.5B", "--ranks", "64", "--dtype", "fp16", "--optimizer", "adam", "--offload", "none"]


def test_command_estimate(capsys):
    code, out, _ = _run(PAPER_ARGS, capsys)
    assert code == 0
    rows = re.findall(r"^ +64 +(\d) +none +(\S+) +0 ", out, re.M)
    assert rows == [("0", "120"), ("1", "31.4"), ("2", "16.6"), ("3", "1.88")], out
    assert "GB (10^9 bytes)" in out and "K = 12" in out

    code, out, _ = _run(["estimate", "models:TinyLM", "--ranks", "2", "4", "--unit", "B", "--memory", "10000B",
                         "--bucket-bytes", "1024"], capsys)
    assert code == 0 and "laid out as zerocore.wrap lays it out" in out
    est = zerocore.estimate(TinyLM, [2, 4], config={"bucket_bytes": 1024})
    for r in est.rows:
        fits = "yes" if r.device_bytes <= 10000 else "no"
        line = rf"^ +{r.world_size} +{r.stage} +{re.escape(sizing.OFFLOAD_LABELS[r.offload])} +{r.device_bytes:,} " \
               rf"+{r.host_bytes:,} .* {fits}$"
        assert re.search(line, out, re.M), (line, out)

    code, out, _ = _run(["estimate", "--memory", "80GB", "--ranks", "64", "--stage", "3"], capsys)
    assert code == 0 and "320,000,000,000 (320B)" in out and "no limit" in out


def test_command_errors(capsys):
    for argv, message in ((["estimate"], "give a model"),
                          (["estimate", "zerocore.examples.train:nothing"], "has no nothing"),
                          (["estimate", "1B", "--memory", "80"], "unit"),
                          (["estimate", "--memory", "80GB", "--delayed-update"], "--delayed-update")):
        code, out, err = _run(argv, capsys)
        assert code == 1 and err.startswith("zerocore estimate: ") and message in err, (argv, err)


def test_command_help(capsys):
    for argv, words in ((["--help"], ["export", "estimate"]),
                        (["export", "--help"], ["checkpoint", "safetensors"]),
                        (["estimate", "--help"], ["--ranks", "--memory", "--offload", "module:function",
                                                  "config.json", "largest model"])):
        with pytest.raises(SystemExit) as e:
            main(argv)
        out = capsys.readouterr().out
        assert e.value.code == 0 and out.startswith("usage: zerocore")
        assert all(w in out for w in words), (argv, out)


def test_console_script_is_declared():
    text = (ROOT / "pyproject.toml").read_text()
    scripts = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[)", text, re.M | re.S)
    assert scripts and re.search(r'^zerocore = "zerocore\.__main__:main"$', scripts.group(1), re.M)


def _zerocore_command():
    """The installed console script (pip puts it beside the interpreter), if any."""
    beside = Path(sys.executable).parent / "zerocore"
    return str(beside) if beside.is_file() else shutil.which("zerocore")


@pytest.mark.parametrize("how", ["zerocore", "python -m zerocore"])
def test_the_command_runs(how):
    """The installed console script and `python -m zerocore`, each in a
    process of its own: --help, and the paper's row."""
    command = [sys.executable, "-m", "zerocore"] if how != "zerocore" else [_zerocore_command()]
    if command == [None]:
        pytest.skip("no zerocore console script installed (pip install . puts one beside python)")
    env = readme.environment()
    usage = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: zerocore"), usage.stdout + usage.stderr
    run = subprocess.run([*command, *PAPER_ARGS], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0 and re.search(r"^ +64 +3 +none +1\.88 ", run.stdout, re.M), run.stdout + run.stderr


def test_docs_examples_run_as_written(tmp_path, capsys, monkeypatch):
    section = readme.section("Will it fit? `zerocore estimate`", "docs/estimate.md")
    [bash], [shown], [python] = (readme.blocks(section, language) for language in ("bash", "text", "python"))
    command = _zerocore_command()
    shim = "" if command else f'zerocore() {{ "{sys.executable}" -m zerocore "$@"; }}\n'
    prefix = f'PATH="{Path(command).parent}:$PATH"\n' if command else shim
    out = readme.run_shell(prefix + bash, tmp_path)
    for line in shown.splitlines():  # the paper's row, as the page shows it
        assert line in out.splitlines(), (line, out)
    assert "6,738,415,616 trainable params" in out  # the Llama config the page writes
    assert "320,000,000,000 (320B)" in out

    monkeypatch.chdir(tmp_path)
    exec(compile(python, "docs/estimate.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "1.88" in printed and "320000000000" in printed
