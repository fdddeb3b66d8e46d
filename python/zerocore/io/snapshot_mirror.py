"""The in-memory snapshots' peer mirrors (docs/snapshots.md): each rank's
newest snapshot file sent to the ranks `offsets` after it
(snapshot.mirror_offsets), and the files of the ranks as far before it
received, each straight into the map of the older of the two files kept of
that rank (snapshot_files.KeptFiles), then renamed into place. Every rank
sends and receives the same mirrors, one snapshot after another, on the
snapshots' own thread, behind the next step's forward and backward
(snapshot.Snapshots.seal), never on the training thread.

The bytes travel over a transport of their own (io/snapshot_transport.py:
over TCP sockets on a CPU engine, staged through device chunks over NCCL
on a GPU), not the engine's data plane queue (comm/communicator.py's
CommQueue), which cannot carry them well:
- a mirror is one rank's bytes to one peer; the queue carries collectives
  only, and the one that could carry it, an all-gather, would move every
  rank's snapshot to every rank: N times the bytes and the memory;
- the queue is in order: the mirror (a rank's whole partition, ~12 bytes
  a param of it with Adam) would sit ahead of the next step's gathers and
  reductions and hold them up by its whole transfer, where on a group of
  its own it only shares the links;
- its volume would enter the step's order contract (the fingerprint every
  rank checks once a step) and comm_stats, which predict the ZeRO formulas'
  volume, not the snapshots'.
"""
from __future__ import annotations

import torch

from zerocore.io.snapshot_files import KeptFiles, file_name


class Mirrors:
    """This rank's side of the mirrors: sends to rank + k and receives from
    rank - k (mod the world) for each k of `offsets`, by `transport`
    (io/snapshot_transport.py); the files received kept in `directory`."""

    def __init__(self, transport, rank: int, world_size: int, offsets: list, directory: str):
        self.transport, self.rank, self.world_size, self.offsets = transport, rank, world_size, offsets
        self._files = {k: KeptFiles(directory, (rank - k) % world_size) for k in offsets}

    def send(self, outgoing: torch.Tensor, generation: int, step: int):
        """Sends `outgoing` (the bytes of this rank's file of `step`) to
        each mirror and receives each peer's file of that step, renamed
        into place once whole; returns when all are done. Each file's size
        comes first (8 bytes)."""
        for k in self.offsets:
            dst, src = (self.rank + k) % self.world_size, (self.rank - k) % self.world_size
            incoming_size = torch.empty(1, dtype=torch.int64)
            self.transport.exchange(torch.tensor([outgoing.numel()], dtype=torch.int64).view(torch.uint8), dst,
                                    incoming_size.view(torch.uint8), src)
            incoming = self._files[k].open(int(incoming_size))
            self.transport.exchange(outgoing, dst, incoming, src)
            self._files[k].commit(file_name(generation, step, src, self.world_size))

    def close(self):
        """The transport's connections and buffers released (engine.close)."""
        if self.transport is not None:
            self.transport.close()
