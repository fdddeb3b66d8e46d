"""The device index right by construction. Every rank of the GPU tests on
one machine is cuda:0, so a collective issued on the wrong device cannot
show there: torch's NCCL group works on the issuing thread's current
device, and the comm queue's issuing thread is a native thread whose current
device is cuda:0 unless something sets it. So the torch transport makes the
tensors' device current for each CUDA collective it issues; here, without a
GPU, a fake device table (torch.cuda.device and torch.cuda.stream replaced
by ones that only keep the current index) shows the collective starting on
its tensors' device, cuda:3, and the thread's device restored after. The
native NCCL transport and CUDA's GroupStream set the device in C++ on every
call (cudaSetDevice / DeviceGuard), as the CUDA backend does."""
import contextlib

import torch
import torch.distributed as dist

from dist_harness import run_ranks
from zerocore.comm.process_group import ProcessGroupTransport


def _issue_on_device_3(rank, world):
    current = [0]  # the fake table: the issuing thread's current device

    class FakeDevice:
        def __init__(self, device):
            self.index = torch.device(device).index

        def __enter__(self):
            self.previous, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.previous

    torch.cuda.device = FakeDevice
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    transport = ProcessGroupTransport(dist.group.WORLD)
    transport.stream = object()  # issue_on's ExternalStream needs a GPU; the fake stream context ignores it
    seen = []
    done = transport._issue((0, 0, 0, 4), torch.device("cuda", 3), lambda: (seen.append(current[0]) or [], None))
    return seen, current[0], done


def test_a_cuda_collective_is_issued_on_its_tensors_device():
    seen, after, done = run_ranks(_issue_on_device_3, 1)[0]
    assert seen == [3], "the collective started on another device than its tensors'"
    assert after == 0 and done is None
