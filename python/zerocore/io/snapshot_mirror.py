"""The in-memory snapshots' peer mirrors (docs/snapshots.md): each rank's
newest snapshot file sent to the ranks `offsets` after it
(snapshot.mirror_offsets), and the files of the ranks as far before it
received, each straight into the map of the older of the two files kept of
that rank (snapshot_files.KeptFiles): post() starts every send and
receive, finish() waits for them and puts the files received into place
(snapshot.Snapshots.seal says on which thread). Every rank posts the same
sends and receives, one snapshot after another.

They travel over a gloo process group of their own, not the engine's
data plane (comm/communicator.py's CommQueue, the comm stream), because that plane
cannot carry them well:
- a mirror is one rank's bytes to one peer; the queue carries collectives
  only, and the one that could carry it, an all-gather, would move every
  rank's snapshot to every rank: N times the bytes and the memory;
- the queue is in order: the mirror (a rank's whole partition, ~12 bytes
  a param of it with Adam) would sit ahead of the next step's gathers and
  reductions and hold them up by its whole transfer, where on a group of
  its own it only shares the links;
- the snapshot lives in host shared memory (it must outlive the process);
  with NCCL the data plane moves device memory, so each mirror would need
  a device buffer of the partition's size on both ranks and a copy up and
  down over PCIe beside the step's own (offload's) traffic;
- its volume would enter the step's order contract (the fingerprint every
  rank checks once a step) and comm_stats, which predict the ZeRO formulas'
  volume, not the snapshots'.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from zerocore.io.snapshot_files import KeptFiles, file_name


class Mirrors:
    """This rank's side of the mirrors: sends to rank + k and receives from
    rank - k (mod the world) for each k of `offsets`, over `group`; the
    files received kept in `directory`."""

    def __init__(self, group, rank: int, world_size: int, offsets: list, directory: str):
        self.group, self.rank, self.world_size, self.offsets = group, rank, world_size, offsets
        self._files = {k: KeptFiles(directory, (rank - k) % world_size) for k in offsets}
        self._in_flight = []  # (works, k, the name of the file received once whole)

    def post(self, outgoing: torch.Tensor, generation: int, step: int):
        """Starts sending `outgoing` (the bytes of this rank's file of
        `step`, which must stay unchanged until finish) to each mirror and
        receiving each peer's file of that step; returns once they are
        posted (each file's size comes first, waited for: tiny)."""
        for k in self.offsets:
            dst, src = (self.rank + k) % self.world_size, (self.rank - k) % self.world_size
            incoming_size = torch.empty(1, dtype=torch.int64)
            for w in self._exchange(torch.tensor([outgoing.numel()], dtype=torch.int64), dst, incoming_size, src, k):
                w.wait()
            incoming = self._files[k].open(int(incoming_size))
            self._in_flight.append((self._exchange(outgoing, dst, incoming, src, k), k,
                                    file_name(generation, step, src, self.world_size)))

    def finish(self):
        """Waits for the mirrors posted; each file received is renamed into place."""
        in_flight, self._in_flight = self._in_flight, []
        for works, k, name in in_flight:
            for w in works:
                w.wait()
            self._files[k].commit(name)

    def _exchange(self, out, dst, into, src, tag) -> list:
        return [dist.isend(out, group=self.group, group_dst=dst, tag=tag),
                dist.irecv(into, group=self.group, group_src=src, tag=tag)]
