"""The checking CPU backend from Python: a host read of what a stream wrote,
without waiting for it, raises naming both accesses and the buffer; with the
wait it is clean and reads what was written. The engine's hooks declare
their use of gathered params and grads the same way."""
import pytest
import torch

from zerocore import _native

N = 1027


def produced(backend, gen):
    """A device buffer the comm stream copies random values into; returns the
    buffer's torch view, the values and the stream."""
    comm = backend.create_stream("comm")
    buf = torch.from_dlpack(backend.allocate("device", N * 4, "gathered_unit").view(0, "float32", [N]))
    values = torch.randn(N, generator=gen)
    backend.copy(comm, buf, values)
    return buf, values, comm


def test_missing_wait_is_named(gen):
    backend = _native.CheckingBackend(seed=int(torch.randint(2**31, (), generator=gen)))
    buf, _, _ = produced(backend, gen)
    with pytest.raises(_native.StreamOrderError) as raised:
        backend.declare_access(backend.compute_stream(), buf, "read", "forward of unit 3")
    message = str(raised.value)
    assert "buffer 'gathered_unit' (device)" in message
    assert f"'copy' on stream 'comm' writes bytes [0, {N * 4})" in message
    assert f"'forward of unit 3' on stream 'compute' reads bytes [0, {N * 4})" in message
    assert len(backend.violations()) == 1
    with pytest.raises(_native.StreamOrderError, match="1 stream-order violation"):
        backend.check()


def test_counting_mode_reads_stale_data(gen):
    """Late completion: the unwaited read sees the buffer's NaN, not the copy."""
    backend = _native.CheckingBackend(seed=1, min_delay_us=100000, max_delay_us=100000, throw_on_violation=False)
    buf, values, comm = produced(backend, gen)
    backend.declare_access(backend.compute_stream(), buf, "read", "forward of unit 3")
    assert torch.isnan(buf).all()
    assert len(backend.violations()) == 1
    backend.host_wait(backend.record(comm))
    assert torch.equal(buf, values)


def test_ordered_read_is_clean(gen):
    backend = _native.CheckingBackend(seed=int(torch.randint(2**31, (), generator=gen)))
    buf, values, comm = produced(backend, gen)
    event = backend.record(comm)
    backend.wait(backend.compute_stream(), event)
    backend.declare_access(backend.compute_stream(), buf, "read", "forward of unit 3")
    assert torch.equal(buf, values)
    backend.host_wait(event)
    assert backend.violations() == [] and backend.host_waits() == 1
    assert backend.take_host_waits() == 1 and backend.host_waits() == 0
    backend.check()
