"""The checkpoint's files, written and read (docs/checkpoint.md).

    CHECKPOINT/zerocore.json                      the manifest (the commit point)
    CHECKPOINT/<save id>/rank-RRRRR-of-WWWWW.safetensors

The layout does not depend on the world size or stage that wrote it: each
rank file holds stretches of params, keyed "<kind>/<param name>/<first
element>" (kind: "param" for the fp32 values, or an optimizer state such as
"exp_avg"), 1-D float32 elements first.. of the flattened param. A reader
at any world size and stage assembles whatever stretches it needs from
whichever files hold them. Rank 0's file also holds the module's buffers
("buffer/<name>"); every rank's, its RNG states ("rng/cpu",
"rng/cuda/<device>").

Every rank file names its save id and carries a CRC-32C of each of its
tensors in its metadata (kernels/crc32c.h: in hardware on x86-64; files
written before it carry zlib's CRC-32, under "crc32", still read); the manifest carries one of itself and lists the
rank files with their sizes. So a file that is missing, truncated, from
another save, or changed by a single bit is found, and named, before any
of its values is used.
"""
from __future__ import annotations

import bisect
import json
import os
import zlib

import torch

from zerocore import _native
from zerocore.io import safetensors_file

MANIFEST = "zerocore.json"
FORMAT, VERSION = "zerocore-checkpoint", 1
_META_KEY = "zerocore"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or used as asked; raised on every
    rank, with the engine as it was."""


def checksum(t: torch.Tensor) -> int:
    """The CRC-32C of a contiguous CPU tensor's bytes."""
    return _native.crc32c(t.reshape(-1).view(torch.uint8))


def copy_with_checksum(dst: torch.Tensor, src: torch.Tensor) -> int:
    """Copies contiguous CPU tensor src's bytes into dst (CPU bytes of the
    same size) and returns their CRC-32C (checksum), in one pass."""
    return _native.copy_crc32c(dst, src.reshape(-1).view(torch.uint8))


# A rank file's checksums are under the name of their algorithm.
_CHECKSUMS = {"crc32c": checksum, "crc32": lambda t: zlib.crc32(safetensors_file.tensor_bytes(t))}


def rank_file(save_id: str, rank: int, world_size: int) -> str:
    """A rank file's path, relative to the checkpoint."""
    return f"{save_id}/rank-{rank:05d}-of-{world_size:05d}.safetensors"


def stretch_key(kind: str, name: str, first: int) -> str:
    return f"{kind}/{name}/{first}"


# Writing ----------------------------------------------------------------------
def write_rank_file(path, save_id: str, rank: int, world_size: int, tensors: dict, metadata=None, fsync=True):
    """One rank's file, with its checksums, flushed to disk (fsync: for a
    file in memory, False). metadata: more strings to keep in its header."""
    # Checksummed and written from host memory: a CUDA engine's states come down here.
    tensors = {key: t.detach().contiguous().cpu() for key, t in tensors.items()}
    crcs = {key: checksum(t) for key, t in tensors.items()}
    safetensors_file.write(path, [(k, t.dtype, t.shape, t) for k, t in tensors.items()],
                           rank_file_metadata(save_id, rank, world_size, crcs, metadata), fsync=fsync)


def rank_file_metadata(save_id: str, rank: int, world_size: int, crcs: dict, metadata=None) -> dict:
    """A rank file's header metadata: `metadata` (more strings) and what
    open_rank_file checks, its save id, rank, world size and the CRC-32C
    of each tensor (crcs: key -> checksum of its bytes)."""
    meta = {"format": FORMAT, "version": VERSION, "id": save_id, "rank": rank, "world_size": world_size,
            "crc32c": crcs}
    return {**(metadata or {}), _META_KEY: json.dumps(meta, separators=(",", ":"))}


def _manifest_crc(manifest: dict) -> int:
    return zlib.crc32(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())


def write_manifest(directory, manifest: dict):
    """The commit: written under a temporary name, flushed, then renamed
    over the last one, so a reader sees the old manifest or the new one."""
    text = json.dumps({"crc32": _manifest_crc(manifest), **manifest}, indent=1)
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST))
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)


# Reading ----------------------------------------------------------------------
def read_manifest(directory) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no checkpoint there (no {MANIFEST})")
    try:
        with open(path) as f:
            manifest = json.load(f)
        stored = manifest.pop("crc32")
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        raise CheckpointError(f"{path}: not a readable checkpoint manifest ({e})") from None
    if stored != _manifest_crc(manifest):
        raise CheckpointError(f"{path}: checksum mismatch: the manifest is corrupt")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r}; "
                              f"this zerocore reads {FORMAT!r} version {VERSION}")
    return manifest


def open_rank_file(path):
    """A rank file, mapped, and its metadata (save id, rank, world size,
    "checksums": a checksum per tensor, "checksum": the function that
    computes them); CheckpointError when it is not one."""
    try:
        reader = safetensors_file.Reader(path)
        meta = json.loads(reader.metadata[_META_KEY])
        algorithm = next(name for name in _CHECKSUMS if name in meta)
        meta["checksums"], meta["checksum"] = dict(meta.pop(algorithm)), _CHECKSUMS[algorithm]
        meta["id"] = str(meta["id"])
    except (safetensors_file.SafetensorsError, KeyError, ValueError, TypeError, StopIteration) as e:
        raise CheckpointError(f"{path}: not a zerocore rank file ({type(e).__name__}: {e})") from None
    if set(meta["checksums"]) != set(reader.entries):
        raise CheckpointError(f"{path}: its header names other tensors than it was written with (corrupt)")
    return reader, meta


class _Stretch:
    """A stored stretch of one param: elements first..first+numel-1."""

    def __init__(self, first, numel, reader, key):
        self.first, self.numel, self.reader, self.key = first, numel, reader, key


class CheckpointReader:
    """A committed checkpoint: its manifest and rank files, opened and
    checked (names, sizes, save ids), with every stretch indexed by kind and
    param name. Tensor bytes are read only when used; verify() reads and
    checks the checksums of the ones a reader will use."""

    def __init__(self, directory):
        self.directory = str(directory)
        self.manifest = m = read_manifest(directory)
        self.files = []
        self._stretches = {}  # (kind, name) -> [_Stretch] by first element
        self.named = {}  # (saving rank, other key: "buffer/...", "rng/...") -> reader
        self._crc = {}  # (reader path, key) -> stored checksum
        self._checksum = {}  # reader path -> the function of its checksums
        for rank, entry in enumerate(m["files"]):  # None: a file this reader does not open (io/snapshot_restore.py)
            if entry is not None:
                self.files.append(self._open(rank, entry))
        for stretches in self._stretches.values():
            stretches.sort(key=lambda s: s.first)
        self._firsts = {k: [s.first for s in v] for k, v in self._stretches.items()}

    def _open(self, rank, entry):
        path = os.path.join(self.directory, entry["path"])
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: missing (the checkpoint lists it; was it deleted or not copied?)")
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes, the manifest says {entry['bytes']} (truncated or "
                                  "overwritten)")
        reader, meta = open_rank_file(path)
        crcs, save_id = meta["checksums"], meta["id"]
        self._checksum[path] = meta["checksum"]
        if save_id != self.manifest["id"]:
            raise CheckpointError(f"{path}: belongs to save {save_id}, the manifest to save {self.manifest['id']} "
                                  "(files of different checkpoints mixed)")
        for key, (dtype, shape, _) in reader.entries.items():
            self._crc[(path, key)] = crcs[key]
            kind, _, rest = key.partition("/")
            name, _, first = rest.rpartition("/")
            if kind in ("buffer", "rng"):
                self.named[(rank, key)] = reader
            elif dtype != torch.float32 or not first.isdigit():
                raise CheckpointError(f"{path}: {key} is not a stretch of a param (corrupt)")
            else:
                self._stretches.setdefault((kind, name), []).append(_Stretch(int(first), shape.numel(), reader, key))
        return reader

    # Checking ----------------------------------------------------------------
    def _overlapping(self, kind, name, first, numel):
        stretches = self._stretches.get((kind, name), [])
        i = max(bisect.bisect_right(self._firsts.get((kind, name), []), first) - 1, 0)
        out, covered = [], first
        for s in stretches[i:]:
            if s.first >= first + numel:
                break
            if s.first + s.numel <= first:
                continue
            if s.first > covered:
                break
            out.append(s)
            covered = max(covered, s.first + s.numel)
        if covered < first + numel:
            raise CheckpointError(f"{self.directory}: holds no {kind} values for elements {covered}.."
                                  f"{first + numel - 1} of {name} (a rank file is missing stretches)")
        return out

    def verify(self, wanted):
        """Reads and checks every stored tensor that the (kind, name, first,
        numel) stretches in `wanted`, and the named keys, will be read from."""
        seen = set()
        for kind, name, first, numel in wanted:
            for s in self._overlapping(kind, name, first, numel):
                seen.add((s.reader, s.key))
        for reader, key in seen:
            self._verify(reader, key)

    def verify_named(self, key, rank=0):
        """Checks another key of saving rank `rank`'s file."""
        if (rank, key) not in self.named:
            raise CheckpointError(f"{self.directory}: holds no {key} (rank {rank}'s file)")
        self._verify(self.named[(rank, key)], key)

    def _verify(self, reader, key):
        if self._checksum[reader.path](reader.get(key)) != self._crc[(reader.path, key)]:
            raise CheckpointError(f"{reader.path}: checksum mismatch in {key}: the file is corrupt")

    # Reading -----------------------------------------------------------------
    def read(self, kind, name, first, numel) -> torch.Tensor:
        """Elements first..first+numel-1 of the flattened param, fp32: a
        view of the file where one stretch holds them all."""
        stretches = self._overlapping(kind, name, first, numel)
        if len(stretches) == 1:
            s = stretches[0]
            return s.reader.get(s.key)[first - s.first:first - s.first + numel]
        out = torch.empty(numel, dtype=torch.float32)
        for s in stretches:
            lo, hi = max(first, s.first), min(first + numel, s.first + s.numel)
            out[lo - first:hi - first].copy_(s.reader.get(s.key)[lo - s.first:hi - s.first])
        return out

    def get(self, key, rank=0) -> torch.Tensor:
        """Another key of saving rank `rank`'s file."""
        return self.named[(rank, key)].get(key)

    def rng_keys(self, rank) -> list:
        """The RNG states saving rank `rank` left (none past the saving world)."""
        return [k for r, k in self.named if r == rank and k.startswith("rng/")]

    def close(self):
        for r in self.files:
            r.close()
