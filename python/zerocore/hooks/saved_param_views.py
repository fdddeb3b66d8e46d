"""Saved tensors: a released unit may be gathered again into another buffer
of the pool. Autograd saves a leaf param as the param itself, which follows
the rebinding; a view of a param (W.t() inside a linear) it saves as is, so
forward runs under saved_tensors_hooks (SavedParamViews) that pack such a
view as (unit, offset, sizes, strides) and unpack it as a view of the
buffer the unit is gathered in when backward needs it.
"""
import functools
import weakref

import torch

from zerocore.hooks.eager import eager


class SavedParamViews(torch.autograd.graph.saved_tensors_hooks):
    """What forward saves for backward, with views of gathered params packed
    as (unit, storage offset, sizes, strides) and unpacked as views of the
    buffer the unit is gathered in by then, which may be another one."""

    def __init__(self, scheduler):
        # Hooks that hold the scheduler weakly and not this object: no
        # reference cycle, so a closed engine's memory goes at once.
        ref = weakref.ref(scheduler)
        super().__init__(functools.partial(_pack, ref), functools.partial(_unpack, ref))


@eager
def _pack(scheduler, t):
    if t.layout == torch.strided and not t.is_meta:
        unit = scheduler().at.get(t.untyped_storage().data_ptr())
        if unit is not None:
            return _ParamView(unit, t.storage_offset(), t.shape, t.stride())
    return t


@eager
def _unpack(scheduler, packed):
    if isinstance(packed, _ParamView):
        live = scheduler()
        if live is None:
            raise RuntimeError("zerocore: this backward needs params of an engine that was closed (engine.close()); "
                               "run backward before closing the engine")
        return live.buffer_of(packed.unit).as_strided(packed.sizes, packed.strides, packed.offset)
    return packed


class _ParamView:
    __slots__ = ("unit", "offset", "sizes", "strides")

    def __init__(self, unit, offset, sizes, strides):
        self.unit, self.offset, self.sizes, self.strides = unit, offset, sizes, strides
