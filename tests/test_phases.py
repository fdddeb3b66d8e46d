"""tests/phases.sh, the time-limited steps of tests/gpu.sh and bench/gpu_run.sh:
a failing step is recorded and the next still runs; a step past the
deadline is skipped; an outer limit ends an inner script's steps, their
children included (a lent GPU must not keep running a hung test)."""
import os
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bash(script: str, timeout: float = 60):
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source tests/phases.sh; {script}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_a_failure_is_recorded_and_the_next_phase_runs():
    out = _bash("phase one 10 false; phase two 10 true; phases_end")
    assert out.returncode == 1
    assert "=== one: FAILED (exit 1)" in out.stdout and "=== two: ok" in out.stdout
    assert "=== failed: one" in out.stdout
    assert _bash("phase two 10 true; phases_end").returncode == 0


def test_the_deadline_cuts_a_limit_and_skips_what_is_past_it():
    t0 = time.monotonic()
    out = _bash("PHASES_DEADLINE=$((SECONDS + 2)); phase slow 100 sleep 30; phase next 100 true; phases_end")
    assert time.monotonic() - t0 < 20
    assert "=== slow: TIMED OUT" in out.stdout and "=== next: SKIPPED" in out.stdout
    assert out.returncode == 1


def test_an_outer_limit_ends_the_inner_phases_children(tmp_path):
    inner = tmp_path / "inner.sh"
    inner.write_text("source tests/phases.sh\nphase inner 100 bash -c 'sleep 97 & sleep 98; wait'\nphases_end\n")
    out = _bash(f"phase outer 2 env PHASES_NESTED=1 bash {inner}; phases_end")
    assert "=== outer: TIMED OUT" in out.stdout
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", "sleep 9[78]"], capture_output=True, text=True).stdout
    assert not left, f"processes of the inner phase still run: {left}"
