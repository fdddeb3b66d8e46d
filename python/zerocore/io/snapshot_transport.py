"""How a snapshot mirror's bytes travel between two ranks
(io/snapshot_mirror.py sends them; docs/snapshots.md): one exchange at a
time, `out` (host bytes: this rank's snapshot file, in shared memory) to
rank `dst` while rank `src`'s arrive into `into` (the map of the file
kept of it), over connections among the engine's ranks for the mirrors
alone. Called on the snapshots' own thread, never the training thread.

Two transports, one a data plane:
- SocketTransport (io/snapshot_sockets.py): a gloo data group (CPU
  engines): TCP connections of the snapshots' thread at gloo's address,
  the host bytes sent as they are.
- StagedTransport: an NCCL data group (torch's, or the native transport's
  communicator) on a GPU: the mirror goes over an NCCL group of its own
  made from the data group's ranks (the data plane's fast network, never
  its in-order queue, where a whole partition would sit ahead of the
  step's gathers and reductions), on a stream of its own, through a small
  double-buffered device chunk buffer: each chunk copied up, exchanged,
  copied down into the peer's file, the next chunk copied up while one is
  in flight. Its loop runs on any device (the tests run it on the CPU
  over gloo).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from zerocore.comm.process_group import private_group
from zerocore.io.snapshot_sockets import SocketTransport

CHUNK_BYTES = 4 << 20  # a staging chunk: 4 buffers of it on the device (2 to send, 2 to receive)


class StagedTransport:
    """The mirrors' bytes staged through two chunk buffers a direction on
    `device`, exchanged over `group` (NCCL on a GPU) on a stream of its own."""

    def __init__(self, group, device: torch.device, chunk_bytes: int = CHUNK_BYTES):
        self.group, self.chunk = group, chunk_bytes
        self.send_buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.recv_buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.device_bytes = sum(b.numel() for b in self.send_buffers + self.recv_buffers)  # memory_report counts them

    def close(self):
        """Its device buffers freed now (engine.close)."""
        self.send_buffers, self.recv_buffers, self.device_bytes = [], [], 0

    def exchange(self, out: torch.Tensor, dst: int, into: torch.Tensor, src: int):
        """Chunk i of `out` (copied up into send buffer i % 2) goes while
        chunk i of `into` comes (into receive buffer i % 2), as many
        chunks each way as each side holds. A buffer is written again two
        chunks later, after its exchange was waited for (on a GPU: the
        stream waits for the group's, and the copies follow on it)."""
        n_out, n_in = -(-out.numel() // self.chunk), -(-into.numel() // self.chunk)
        in_flight = None  # (works, receive buffer, where its bytes go) of the chunk exchanged last
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for i in range(max(n_out, n_in)):
                ops = []
                if i < n_out:
                    piece = out[i * self.chunk:(i + 1) * self.chunk]
                    staged = self.send_buffers[i % 2][:piece.numel()]
                    staged.copy_(piece, non_blocking=True)
                    ops.append(dist.P2POp(dist.isend, staged, group=self.group, group_peer=dst))
                landing = received = None
                if i < n_in:
                    landing = into[i * self.chunk:(i + 1) * self.chunk]
                    received = self.recv_buffers[i % 2][:landing.numel()]
                    ops.append(dist.P2POp(dist.irecv, received, group=self.group, group_peer=src))
                works = dist.batch_isend_irecv(ops)
                if in_flight is not None:
                    self._land(*in_flight)
                in_flight = (works, received, landing)
            if in_flight is not None:
                self._land(*in_flight)
            if self.stream is not None:
                self.stream.synchronize()

    @staticmethod
    def _land(works, received, landing):
        """A chunk's exchange waited for; what came copied down into its place."""
        for w in works:
            w.wait()
        if landing is not None:
            landing.copy_(received)  # blocking: host memory the driver cannot page-lock


def for_engine(host_group, group, device: torch.device, timeout, nccl: str):
    """The mirrors' transport: staged over an NCCL group of `group`'s
    ranks of its own (private_group; `timeout`: Config.timeout, as the
    engine's other groups) where the engine runs on a GPU over an NCCL
    data group (torch's, or the native transport's: Config.nccl, `nccl`);
    over sockets of their own otherwise (`host_group`, the snapshots' gloo
    group, which the restores use too, gathers their addresses). None
    without a group (a rank alone)."""
    if group is None:
        return None
    if device.type == "cuda" and (nccl == "native" or "nccl" in dist.get_backend_config(group)):
        return StagedTransport(private_group(group, timeout, "nccl"), device)
    return SocketTransport(host_group, timeout)
