"""zerocore.io.export: a checkpoint's consolidated model as one safetensors file.

The file holds what module.state_dict() would: every param in fp32 under
each of its names (tied weights under each), and the persistent buffers,
in state_dict order, so model.load_state_dict loads it. It is assembled and
written one tensor at a time, checksums checked as it goes, so exporting
never holds more than the largest param in memory. The output appears
under its name only once it is whole.
"""
from __future__ import annotations

import os

import torch

from zerocore.io import safetensors_file
from zerocore.io.checkpoint_format import CheckpointReader


def export(checkpoint, out):
    """Writes checkpoint folder `checkpoint`'s model to the safetensors file `out`."""
    ckpt = CheckpointReader(checkpoint)
    m = ckpt.manifest
    params = {name: entry for entry in m["params"] for name in entry["names"]}

    def param(entry):
        name, numel = entry["names"][0], torch.Size(entry["shape"]).numel()
        ckpt.verify([("param", name, 0, numel)])
        return ckpt.read("param", name, 0, numel).view(entry["shape"])

    def buffer(name):
        ckpt.verify_named(f"buffer/{name}")
        return ckpt.get(f"buffer/{name}")

    entries = []
    for key in m["state_dict_keys"]:
        if key in params:
            entries.append((key, torch.float32, params[key]["shape"], lambda e=params[key]: param(e)))
        else:
            b = m["buffers"][key]
            entries.append((key, getattr(torch, b["dtype"]), b["shape"], lambda k=key: buffer(k)))
    tmp = f"{out}.tmp"
    try:
        safetensors_file.write(tmp, entries, {"format": "pt"}, fsync=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
        ckpt.close()
