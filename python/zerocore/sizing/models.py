"""What zerocore.estimate sizes: a param count, a module (built on the meta
device, nothing allocated), a function or "module:function" building one,
or a Hugging Face config.json (the param count of the architectures in
HF_ARCHITECTURES, from the config alone)."""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re

from zerocore.sizing.quantities import EstimateError, parse_count


def _gpt2(c) -> int:
    d, layers, vocab = c["n_embd"], c["n_layer"], c["vocab_size"]
    positions = c["n_positions"] if "n_positions" in c else c["n_ctx"]
    inner = c.get("n_inner") or 4 * d
    # ln_1, attention (c_attn, c_proj, with biases), ln_2, mlp (c_fc, c_proj, with biases)
    layer = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * inner + inner) + (inner * d + d)
    head = 0 if c.get("tie_word_embeddings", True) else vocab * d
    return vocab * d + positions * d + layers * layer + 2 * d + head


def _llama(c) -> int:
    d, inner, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or d // heads
    attn = 2 * d * heads * hd + 2 * d * kv * hd  # q, o; k, v
    if c.get("attention_bias", False):
        attn += heads * hd + 2 * kv * hd + d
    mlp = 3 * d * inner + ((2 * inner + d) if c.get("mlp_bias", False) else 0)  # gate, up, down
    head = 0 if c.get("tie_word_embeddings", False) else vocab * d
    return vocab * d + layers * (attn + mlp + 2 * d) + d + head  # two RMSNorms a layer, the final one


HF_ARCHITECTURES = {"gpt2": _gpt2, "llama": _llama, "mistral": _llama}


def hf_param_count(config) -> int:
    """Params of the Hugging Face model a config.json describes (a dict, or
    the path of the file or of its folder), without transformers: the
    model_types of HF_ARCHITECTURES."""
    if not isinstance(config, dict):
        path = os.path.join(config, "config.json") if os.path.isdir(config) else config
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise EstimateError(f"cannot read the Hugging Face config {path}: {e}") from None
    kind = config.get("model_type")
    count = HF_ARCHITECTURES.get(kind)
    if count is None:
        raise EstimateError(f"model_type {kind!r} is not one zerocore estimate counts from a config.json; it knows "
                            f"{', '.join(HF_ARCHITECTURES)}. For another model, name a function that builds it, "
                            "as module:function (it is built on the meta device, so nothing is allocated)")
    try:
        return count(config)
    except KeyError as e:
        raise EstimateError(f"the {kind} config.json has no {e.args[0]!r}") from None


@dataclasses.dataclass
class Model:
    """What is estimated: a param count (formula) or a module (its layout)."""

    trainable: int
    frozen: int = 0
    module: object = None  # an nn.Module, laid out as the engine lays it out
    source: str = ""

    @property
    def params(self) -> int:
        return self.trainable + self.frozen


def _build_on_meta(fn, name: str):
    import torch

    with torch.device("meta"):
        try:
            module = fn()
        except TypeError as e:
            raise EstimateError(f"{name}() failed: {e} (the function is called with no arguments)") from None
    if not isinstance(module, torch.nn.Module):
        raise EstimateError(f"{name}() returned a {type(module).__name__}, not a torch.nn.Module")
    return module


def _import_function(spec: str):
    mod_name, _, fn_name = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise EstimateError(f"{spec}: cannot import {mod_name}: {e}") from None
    obj = mod
    for part in fn_name.split("."):
        if not hasattr(obj, part):
            raise EstimateError(f"{spec}: {mod_name} has no {fn_name}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise EstimateError(f"{spec}: {fn_name} is not callable")
    return obj


def as_model(model) -> Model:
    """A Model from a param count, an nn.Module, a function building one,
    "module:function", or a Hugging Face config.json (its path or folder)."""
    if isinstance(model, Model):
        return model
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        return Model(int(model), source="a param count")
    import torch

    if isinstance(model, torch.nn.Module):
        params = list(model.parameters())
        trainable = sum(p.numel() for p in params if p.requires_grad)
        return Model(trainable, sum(p.numel() for p in params) - trainable, model, f"a {type(model).__name__}")
    if callable(model):
        name = getattr(model, "__qualname__", repr(model))
        return dataclasses.replace(as_model(_build_on_meta(model, name)), source=f"{name}() on the meta device")
    if isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
        if os.path.exists(text) or text.endswith(".json"):
            return Model(hf_param_count(text), source=f"the Hugging Face config {text}")
        if re.fullmatch(r"[\w.]+:[\w.]+", text):
            built = as_model(_build_on_meta(_import_function(text), text))
            return dataclasses.replace(built, source=f"{text}() on the meta device")
        return Model(parse_count(text), source="a param count")
    raise EstimateError(f"cannot estimate a {type(model).__name__}; give a param count, a torch.nn.Module, a "
                        "function that builds one, 'module:function', or a Hugging Face config.json")
