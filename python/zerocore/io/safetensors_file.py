"""Reading and writing safetensors files, streaming, without numpy.

The format (https://huggingface.co/docs/safetensors): an 8-byte
little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range in the data that follows (packed, no holes), plus an
optional "__metadata__" map of strings. Checkpoints and exports are written
here so that no file is ever built in memory: each tensor's bytes go
straight from its buffer to the file, and a reader views each tensor in a
memory map, reading from disk only what is used.

Any safetensors reader loads what this writes; this reader reports every
way a file can be broken (short, truncated, a header that does not parse or
points outside the file) as a SafetensorsError naming the file.
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}
_MAX_HEADER = 100 << 20  # as the reference implementation


class SafetensorsError(ValueError):
    """A file that is not a whole, well-formed safetensors file."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (valid while t lives)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def plan(entries, metadata=None, header_bytes=0) -> tuple:
    """A file's layout: (its head, the 8-byte length and the JSON header
    padded with spaces to at least header_bytes bytes, [(entry, the byte of
    the file its data starts at)]). entries: (name, dtype, shape, ...) in
    any order; they go in order of decreasing element size, so every one is
    aligned to its element in the file (the data starts 8-byte aligned).
    Where each entry's bytes go depends on the entries and header_bytes
    alone: a file whose head is reserved may have its data written first
    and its header (checksums, say) after (io/snapshot.py)."""
    order = sorted(entries, key=lambda e: -torch.empty(0, dtype=e[1]).element_size())
    header, offsets, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, dtype, shape, *_ in order:
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offsets.append(offset)
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (max(len(text), header_bytes - 8) - len(text))
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return head, [(entry, len(head) + first) for entry, first in zip(order, offsets)]


def write(path, entries, metadata=None, fsync=False):
    """Writes a safetensors file. entries: (name, dtype, shape, tensor or a
    callable giving it) in any order (plan); a callable is called only
    when its bytes are written, so a file of many large tensors holds one
    at a time."""
    head, placed = plan(entries, metadata)
    with open(path, "wb") as f:
        f.write(head)
        for (name, dtype, shape, value), _ in placed:
            t = value() if callable(value) else value
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"safetensors write: {name} is {t.dtype} {tuple(t.shape)}, declared "
                                 f"{dtype} {tuple(shape)}")
            f.write(tensor_bytes(t.detach().contiguous().cpu()))
        if fsync:
            f.flush()
            os.fsync(f.fileno())


class Reader:
    """A safetensors file, mapped: header checked on open, tensors viewed
    (zero-copy, copy-on-write) on demand."""

    def __init__(self, path):
        self.path = str(path)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 8:
                    raise SafetensorsError(f"{path}: {size} bytes, too short for a safetensors file")
                (n,) = struct.unpack("<Q", f.read(8))
                if n > min(_MAX_HEADER, size - 8):
                    raise SafetensorsError(f"{path}: header of {n} bytes does not fit in the file's {size} "
                                           "(truncated, or not a safetensors file)")
                header = json.loads(f.read(n))
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self.entries = {}
        end = 0
        for name, e in header.items():
            try:
                dtype, shape, (lo, hi) = TORCH_DTYPES[e["dtype"]], torch.Size(e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(f"{path}: header entry {name!r} is malformed: {e!r}") from None
            if hi - lo != shape.numel() * torch.empty(0, dtype=dtype).element_size() or lo < 0:
                raise SafetensorsError(f"{path}: {name}'s byte range {lo}..{hi} does not match its shape")
            self.entries[name] = (dtype, shape, lo)
            end = max(end, hi)
        if self._data_start + end != size:
            raise SafetensorsError(f"{path}: the header describes {self._data_start + end} bytes, the file has "
                                   f"{size} (truncated or overwritten)")

    def get(self, name) -> torch.Tensor:
        """A view of tensor `name` in the mapped file (pages are read on use)."""
        dtype, shape, lo = self.entries[name]
        if shape.numel() == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, count=shape.numel(),
                                offset=self._data_start + lo).view(shape)

    def close(self):
        """Lets go of the map; it is unmapped once no view of it is left."""
        self._map = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
