"""The engine follows torch's current CUDA stream (zerocore/runtime/compute_stream.py),
checked without a GPU: a fake backend records set_compute_stream, and a
fake provider plays torch's current stream.

- The same stream: nothing is called. A stream changed between steps: the
  next forward adopts it (set_compute_stream with the new handle, which
  makes the new stream wait for the old one's work: cuda/tests/
  test_cuda_backend.cpp checks that ordering on a GPU). A stream changed
  inside a step (at a forward after the step's first, at backward, at
  step): a RuntimeError naming both streams and the fix, and nothing
  adopted. A forward without autograd begins no step.
- On a CPU backend nothing is followed: torch's stream is never asked.
- The engine makes these calls at forward, backward, clip_grad_norm_ and
  step, and zero_grad ends a step as step does (a CPU engine given the
  fake). tests/test_gpu_engine.py trains under a side stream on a GPU.
"""
import pytest
import torch

import zerocore
from models import lm_batch, lm_loss, make
from zerocore import _native
from zerocore.runtime import compute_stream
from zerocore.runtime.compute_stream import ComputeStream

WRAPPED = 0x7000  # the stream the backend was made with


class FakeCudaBackend:
    """What ComputeStream uses of a CudaBackend, recording the switches."""
    device = 0

    def __init__(self):
        self.handle, self.switches = WRAPPED, []

    def compute_stream(self):
        return "compute"

    def stream_handle(self, stream):
        assert stream == "compute"
        return self.handle

    def set_compute_stream(self, handle):
        self.switches.append(handle)
        self.handle = handle


class Torch:
    """torch's current stream, as the test sets it."""

    def __init__(self):
        self.stream, self.asked = WRAPPED, 0

    def __call__(self):
        self.asked += 1
        return self.stream


def following():
    backend, current = FakeCudaBackend(), Torch()
    return ComputeStream(backend, current), backend, current


def test_the_same_stream_changes_nothing():
    stream, backend, current = following()
    for _ in range(3):
        stream.follow()
        stream.check("engine.backward")
        stream.follow()
        stream.check("engine.backward")
        stream.check("engine.step")
        stream.end_step()
    assert backend.switches == [] and current.asked == 15


def test_a_stream_changed_between_steps_is_adopted_by_the_next_forward():
    stream, backend, current = following()
    for handle in [0x7100, 0x7100, 0, 0x7200]:
        current.stream = handle
        stream.follow()
        stream.check("engine.backward")
        stream.check("engine.step")
        stream.end_step()
    assert backend.switches == [0x7100, 0, 0x7200]


@pytest.mark.parametrize("where", ["engine.forward", "engine.backward", "engine.clip_grad_norm_", "engine.step"])
def test_a_stream_changed_inside_a_step_is_refused_naming_the_fix(where):
    stream, backend, current = following()
    stream.follow()
    if where != "engine.backward":
        stream.check("engine.backward")  # a step under way: the next forward accumulates
    current.stream = 0x7300
    with pytest.raises(RuntimeError) as e:
        stream.follow() if where == "engine.forward" else stream.check(where)
    message = str(e.value)
    assert f"zerocore: {where} runs on CUDA stream 0x7300 (torch's current stream on cuda:0)" in message
    assert f"this step's forward and backward ran on {hex(WRAPPED)}" in message
    assert "under the same stream" in message and "after engine.step() or engine.zero_grad()" in message
    assert backend.switches == []
    current.stream = WRAPPED  # back on the step's stream, the step goes on
    stream.check("engine.step")
    stream.end_step()
    current.stream = 0x7300  # and after it the change is taken
    stream.follow()
    assert backend.switches == [0x7300]


def test_the_default_stream_is_named_as_such():
    stream, _, current = following()
    stream.follow()
    current.stream = 0
    with pytest.raises(RuntimeError, match=r"runs on CUDA stream 0 \(the default stream\)"):
        stream.check("engine.backward")


def test_a_forward_without_autograd_begins_no_step():
    stream, backend, current = following()
    with torch.no_grad():
        stream.follow()
        current.stream = 0x7400
        stream.follow()  # evaluation on another stream
    assert backend.switches == [0x7400]
    stream.follow()  # with autograd: a step begins
    current.stream = 0x7500
    with pytest.raises(RuntimeError, match="engine.forward runs on CUDA stream 0x7500"):
        stream.follow()


def test_a_cpu_backend_follows_nothing():
    stream = compute_stream.of(_native.process_backend())
    stream.follow()
    stream.check("engine.backward")
    stream.end_step()
    cpu = ComputeStream(_native.CheckingBackend(), None)
    cpu.follow()
    cpu.check("engine.step")


def _train_step(engine, step, accum=2, clip=False):
    for micro in range(accum):
        x, y = lm_batch(step, micro, 1)
        engine.backward(lm_loss(engine(x), y))
    if clip:
        engine.clip_grad_norm_(1.0)
    engine.step()


def test_the_engine_follows_at_forward_backward_and_step(monkeypatch):
    backend, current = FakeCudaBackend(), Torch()
    monkeypatch.setattr(compute_stream, "of", lambda engine_backend: ComputeStream(backend, current))
    model = make()
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zerocore.Config(stage=0))
    _train_step(engine, 0)
    assert backend.switches == [] and current.asked == 2 + 2 + 1  # forwards, backwards, step
    current.stream = 0x7100  # between steps
    _train_step(engine, 1, clip=True)
    assert backend.switches == [0x7100]

    x, y = lm_batch(2, 0, 1)
    loss = lm_loss(engine(x), y)
    current.stream = 0x7200  # between the forward and its backward
    with pytest.raises(RuntimeError, match="engine.backward runs on CUDA stream 0x7200"):
        engine.backward(loss)
    current.stream = 0x7100
    engine.backward(loss)
    current.stream = 0x7200  # before an accumulating forward
    with pytest.raises(RuntimeError, match="engine.forward runs on CUDA stream 0x7200"):
        engine(x)
    with pytest.raises(RuntimeError, match="engine.clip_grad_norm_ runs on CUDA stream 0x7200"):
        engine.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="engine.step runs on CUDA stream 0x7200"):
        engine.step()
    engine.zero_grad()  # drops the step: the next forward may change streams
    _train_step(engine, 3)
    assert backend.switches == [0x7100, 0x7200]
    engine.close()
