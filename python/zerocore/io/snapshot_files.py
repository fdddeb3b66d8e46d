"""The in-memory snapshots' files on a node (io/snapshot.py takes them,
io/snapshot_restore.py reads them): their names, the two kept of each rank a
rank holds, written over in turn through maps, and the copy of a rank's
tensors into one.

    <dir>/<run id>/rank-HHHHH/g<gen>.step-<step>.rank-RRRRR-of-WWWWW.safetensors

held by rank H (its own, R == H, or a mirror of rank R's) of a world of W
ranks, generation <gen> (one more at each restore: files of a timeline
given up never mix with the one restored). Each is a checkpoint rank file
(io/checkpoint_format.py) whose header has room reserved, so that its data
can be written before its checksums. A file appears whole or not at all:
a rank keeps the two newest steps of each rank it holds, each file mapped
once, and writes over the older one under a temporary name, renamed into
place when whole, so a rank killed mid-write leaves the previous step
whole.
"""
from __future__ import annotations

import mmap
import os
import re
import zlib

import torch

FILE = re.compile(r"g(\d+)\.step-(\d+)\.rank-(\d+)-of-(\d+)\.safetensors")
KEPT_STEPS = 2  # of each rank held: the newest whole while the next is written


def holder_dir(run: str, rank: int) -> str:
    return os.path.join(run, f"rank-{rank:05d}")


def file_name(generation: int, step: int, rank: int, world_size: int) -> str:
    return f"g{generation:04d}.step-{step:012d}.rank-{rank:05d}-of-{world_size:05d}.safetensors"


def save_id(generation: int, step: int, world_size: int) -> str:
    """The checkpoint save id every rank's file of one snapshot carries."""
    return f"g{generation:04d}-s{step:012d}-w{world_size:05d}"


def manifest_crc(text: str) -> int:
    return zlib.crc32(text.encode())


def mapped(f, access) -> torch.Tensor:
    """The bytes of open file f, as a tensor over a memory map of it."""
    return torch.frombuffer(mmap.mmap(f.fileno(), 0, access=access), dtype=torch.uint8)


def _files_of(directory: str, rank: int) -> list:
    """The names of rank `rank`'s files in `directory`, newest (step, then generation) first."""
    files = [(int(m[2]), int(m[1]), m[0]) for m in map(FILE.fullmatch, os.listdir(directory))
             if m and int(m[3]) == rank]
    return [name for *_, name in sorted(files, reverse=True)]


def prune(directory: str, keep=KEPT_STEPS):
    """Of each rank's files in `directory`, the `keep` newest steps stay."""
    ranks = {int(m[3]) for m in map(FILE.fullmatch, os.listdir(directory)) if m}
    for rank in ranks:
        for name in _files_of(directory, rank)[keep:]:
            with_errors_ignored(os.remove, os.path.join(directory, name))


def with_errors_ignored(fn, *args):
    try:
        fn(*args)
    except FileNotFoundError:
        pass  # another rank of the node pruned it first


def runs(placed: list) -> list:
    """placed: (first byte in the file, tensor) in the file's order; the
    same, with tensors that follow on both in the file and in memory (a
    partition's stretches of one buffer do) made one, 1-D: a copy a run of
    them, not one a tensor."""
    out = []
    for first, t in placed:
        if out and t.is_contiguous() and t.numel():
            at, run = out[-1]
            if (run.dim() == 1 and run.is_contiguous() and t.dtype == run.dtype and t.device == run.device
                    and first == at + run.numel() * run.element_size()
                    and t.untyped_storage().data_ptr() == run.untyped_storage().data_ptr()
                    and t.storage_offset() == run.storage_offset() + run.numel()):
                out[-1] = (at, run.as_strided((run.numel() + t.numel(),), (1,)))
                continue
        out.append((first, t.reshape(-1) if t.is_contiguous() else t))
    return out


class KeptFiles:
    """The KEPT_STEPS newest files this rank keeps of one rank it holds
    (its own snapshots, or its mirror of a peer's), each mapped once and
    written over in turn: the older one is renamed to a temporary name,
    written through its map and renamed into place, while the newer one
    stays whole. A write never faults in, frees or zeroes a page of shared
    memory again (most of what a fresh file costs)."""

    def __init__(self, directory: str, rank: int):
        self.dir = directory
        self.tmp = os.path.join(directory, f"rank-{rank:05d}.tmp.{os.getpid()}")  # refused as a snapshot (FILE)
        self.kept = []  # (name, map), oldest first
        self.writing = None  # the map of the file under self.tmp

    def open(self, size: int) -> torch.Tensor:
        """The bytes of the file being written, `size` of them (what they
        held is kept up to that size), under the temporary name."""
        if self.writing is None and len(self.kept) == KEPT_STEPS:
            name, self.writing = self.kept.pop(0)
            try:
                os.replace(os.path.join(self.dir, name), self.tmp)
            except FileNotFoundError:  # removed meanwhile (the folder cleared by hand): a new file
                self.writing = None
        if self.writing is None or len(self.writing) != size:
            self.writing = None  # unmapped before its file is cut (views left in it are never used)
            with open(self.tmp, "a+b") as f:
                f.truncate(size)
                self.writing = mmap.mmap(f.fileno(), size)
        return torch.frombuffer(self.writing, dtype=torch.uint8)

    def commit(self, name: str):
        """The file written is whole: renamed into place as `name`."""
        os.replace(self.tmp, os.path.join(self.dir, name))
        self.kept.append((name, self.writing))
        self.writing = None

    def newest(self) -> torch.Tensor:
        return torch.frombuffer(self.kept[-1][1], dtype=torch.uint8)
