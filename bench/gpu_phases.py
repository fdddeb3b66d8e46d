"""A step's phases timed on the device beside the host (gpu_gpt_bench.py
--breakdown).

The host times (step_breakdown.StepBreakdown's phase.<name>) say how long
the Python took to issue each phase, blocking waits included; the device
times are the intervals between CUDA events recorded on the current stream
at the step's start and after each phase: how far the stream got between
those points, its idle time included. A phase whose device time is far
above its host time ran behind the host, which queued it and went on (the
GPU bounds it); device and host times that match mean one waited for the
other, and the profile (--profile) tells which. "wait" is the host's wait
for the step's loss at its end (the device is done by then): no event.
"""
from __future__ import annotations

PHASES = ("fwd", "bwd", "opt", "zero_grad")


class DevicePhases:
    """CUDA events at each step's start and after each phase; does nothing
    off CUDA. Between end() and the next begin(), phase() records nothing."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.steps = []  # per step: [(phase, event)], the first ("start", event)
        self._marks = None

    @staticmethod
    def _event():
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self):
        if self.cuda:
            self._marks = [("start", self._event())]

    def phase(self, name):
        if self._marks is not None:
            self._marks.append((name, self._event()))

    def end(self):
        if self._marks is not None:
            self.steps.append(self._marks)
            self._marks = None

    def seconds(self) -> list:
        """Each step's {"gpu.<phase>": seconds, "gpu.step": seconds}, after
        waiting for the device."""
        if not self.steps:
            return []
        import torch

        torch.cuda.synchronize()
        return [{**{f"gpu.{name}": a.elapsed_time(b) / 1e3 for (_, a), (name, b) in zip(marks, marks[1:])},
                 "gpu.step": marks[0][1].elapsed_time(marks[-1][1]) / 1e3} for marks in self.steps]


def phase_table(medians: dict) -> list:
    """Lines of a host / GPU table, ms, from medians with phase.<name> (host)
    and gpu.<name> (device) keys; the device column blank where absent."""
    def ms(key):
        return f"{1e3 * medians[key]:9.2f}" if key in medians else f"{'-':>9}"

    lines = [f"  {'phase':<10} {'host ms':>9} {'GPU ms':>9}"]
    lines += [f"  {name:<10} {ms('phase.' + name)} {ms('gpu.' + name)}" for name in PHASES]
    host_step = sum(medians.get(f"phase.{name}", 0.0) for name in PHASES)
    lines.append(f"  {'step':<10} {1e3 * host_step:9.2f} {ms('gpu.step')}   (host: the phases' sum of medians)")
    lines.append(f"  {'wait':<10} {ms('phase.wait')} {'-':>9}   (host: for the step's loss)")
    return lines
