"""The main job's throughput: tokens/s beside each step's loss and the
one-line summary at the end; and its measured model-state memory is what
zerocore.estimate predicts for the job's model."""
import re
import subprocess
import sys

import pytest

import zerocore
from zerocore.examples.train import default_model, throughput_line

STEPS = 3
TOKENS_PER_STEP = 8 * 64  # the job's default global batch: 8 sequences x 64 tokens, 1 micro-batch


def test_throughput_line():
    assert throughput_line([0.5, 0.1, 0.2, 0.1], 512, 2) == (
        "throughput: 3,840 tok/s over steps 2-4 (1,536 tokens in 0.400 s, step 1 left out as warm-up), "
        "1,920 tok/s per rank")
    assert throughput_line([0.25], 512, 4) == "throughput: 2,048 tok/s over step 1 (512 tokens in 0.250 s), " \
                                             "512 tok/s per rank"


def _number(text: str) -> float:
    return float(text.replace(",", ""))


@pytest.fixture(scope="module")
def job_output():
    """The job with its default model and flags (stage 3, 2 ranks, bf16), 3 steps."""
    cmd = [sys.executable, "-m", "zerocore.examples.train", "--steps", str(STEPS), "--timeout", "60"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def test_each_step_prints_tokens_per_second_beside_its_loss(job_output):
    steps = re.findall(r"^step +(\d+)/3 +loss +\d+\.\d{4} +([\d,]+) tok/s +([\d.]+) ms$", job_output, re.M)
    assert [int(s) for s, _, _ in steps] == [1, 2, 3], job_output
    for _, rate, ms in steps:  # tok/s is the step's global batch over its time, as printed (0.1 ms)
        ms = float(ms)
        assert TOKENS_PER_STEP / ((ms + 0.05) / 1e3) - 1 <= _number(rate) <= TOKENS_PER_STEP / ((ms - 0.05) / 1e3) + 1


def test_one_line_throughput_summary(job_output):
    lines = [line for line in job_output.splitlines() if line.startswith("throughput: ")]
    assert len(lines) == 1, job_output
    m = re.fullmatch(r"throughput: ([\d,]+) tok/s over steps 2-3 \(([\d,]+) tokens in ([\d.]+) s, step 1 left out "
                     r"as warm-up\), ([\d,]+) tok/s per rank", lines[0])
    assert m, lines[0]
    rate, tokens, seconds, per_rank = _number(m[1]), int(_number(m[2])), float(m[3]), _number(m[4])
    assert tokens == 2 * TOKENS_PER_STEP
    step_ms = [float(x) for x in re.findall(r"^step +[23]/3 .* ([\d.]+) ms$", job_output, re.M)]
    assert seconds == pytest.approx(sum(step_ms) / 1e3, abs=6e-4)
    assert tokens / (seconds + 5e-4) - 1 <= rate <= tokens / max(seconds - 5e-4, 1e-9) + 1
    assert per_rank == pytest.approx(rate / 2, abs=1)
    # The summary that was there before stays.
    assert re.search(r"^loss \d+\.\d{4} -> \d+\.\d{4} over 3 steps \(uniform guess: ", job_output, re.M)


def test_the_job_holds_what_the_estimate_predicts(job_output):
    est = zerocore.estimate(default_model, 2, "bf16", "adamw", stages=[3], offload=["none"]).row(2, 3)
    for rank in (0, 1):
        measured = {k: int(_number(v)) for k, v in
                    re.findall(rf"^ +{rank}  (param|grad|optim) +([\d,]+) ", job_output, re.M)}
        assert measured == {k: est.total(k) for k in ("param", "grad", "optim")}, job_output
