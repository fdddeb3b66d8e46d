"""ParamBinder: a flat group's part that binds the module's params and
their .grad to the group's buffers.

The module's nn.Parameters keep their identity; their .data are views into
F (the group's flat buffer, its "full"), created once. A sharded group has
no F of its own: stage 3's schedule gathers its unit into a buffer of the native gather
pool and binds the params to views of it (bind), and points them back at
placeholders of their shape that hold one NaN when the unit is released
(unbind), so a stale read gives NaNs instead of another unit's values, and
a write raises (guards.py). The buffer the params view is the binder's
`bound`: F, or while a sharded group's unit is gathered, its pool slot.

Grads: at stages 0-1 each param's .grad is its view of the flat grad
buffer while autograd runs (attach_grad_views), and after backward a
placeholder that raises on use (hide_grads). The user's writes to params
held whole, in place or by rebinding .data, are carried into the buffers
the step updates (carry_param_writes, write_back).
"""
from __future__ import annotations

import torch

from zerocore.state import guards, views


class ParamBinder:
    """Binds a flat group's params and grads to its buffers. params, names:
    the group's (backward order; per param, every name it has); dtype: the
    one it trains in; stage: the ZeRO stage; sharded: stage 3's params held
    as shards; store: its PartitionStore; buffers: its buffers by kind (the
    group's dict, filled once allocated); rank: its rank in the partition."""

    def __init__(self, params, names, *, dtype, stage, sharded, store, buffers, rank):
        self.params, self.names, self.shapes = params, names, [p.shape for p in params]
        self.dtype, self.stage, self.sharded, self.rank = dtype, stage, sharded, rank
        self.store, self.buffers = store, buffers
        self.buckets, self.partition_elems = len(store.plan.buckets), store.plan.partition_elems
        self.bound = None  # the flat buffer the params view: F, or a sharded group's gathered slot; None: released
        self._views = {}  # per buffer address, the params' views into it
        self._placeholders = []
        self._grad_views = None  # per param, its view of grad_full: made once
        self._grad_placeholders = None  # made by hide_grads, once
        self._grads_zeroed = False  # zero_grad zeroed the grad buffers since the last backward
        self._versions = []  # the params' version counters as carry_param_writes last saw them

    # Binding params to a flat buffer ----------------------------------------
    def bind_initial(self):
        """Once the buffers hold the params' values (FlatGroup.fill): the
        params become views of F, or a sharded group's are released."""
        if self.sharded:
            self._placeholders = self._make_placeholders()
            self.unbind()
        else:
            self.bind(self.buffers["full"])

    def _view(self, buffer, span: str, *args) -> torch.Tensor:
        """views.view of `buffer`: a kind of self.buffers or a tensor of the plan."""
        return views.view(self.store, self.buffers[buffer] if isinstance(buffer, str) else buffer, span, *args)

    def _make_placeholders(self) -> list:
        """Per param, a tensor of its shape that reads as NaN everywhere: one
        NaN element repeated by zero strides. A read of a released param
        outside its unit's forward and backward (model.state_dict(),
        printing a weight) gives NaNs instead of another unit's values or
        a crash, and a write raises, since every element is one location."""
        nan = torch.full((1,), float("nan"), dtype=self.dtype, device=self.params[0].device)  # where training runs
        return [nan.expand(shape) for shape in self.shapes]

    def bind(self, flat: torch.Tensor, keep_views=True):
        """The params become views of `flat`, this group's flat buffer (for a
        sharded group, where its unit is gathered). keep_views: the buffer
        lives as long as the engine (a pool slot), so its views are made once
        and kept; a temporary buffer's are not, or they would keep it alive."""
        for p, v in zip(self.params, self._param_views(flat, keep_views)):
            guards.restore(p, v)
        self.bound = flat

    def _param_views(self, flat: torch.Tensor, keep=True) -> list:
        """Per param, its view of `flat` (see bind for keep)."""
        views = self._views.get(flat.data_ptr())
        if views is None:
            views = [self._view(flat, "param", i).view(shape) for i, shape in enumerate(self.shapes)]
            if keep:
                self._views[flat.data_ptr()] = views
        return views

    def undo_casts(self):
        """Params held whole whose .data a cast replaced since wrap
        (model.to(dtype), .half()): they view self.bound again, which holds
        their values in the dtype the engine trains in, untouched by it."""
        if self.bound is None:
            return
        for p, view in zip(self.params, self._param_views(self.bound)):
            if p.dtype != view.dtype and p.shape == view.shape:
                guards.restore(p, view)

    def take_rebound(self, keep_views=True) -> list:
        """Params bound to self.bound whose .data the user rebound since
        (`p.data = t`, `p.set_(t)`): their values go into their place in
        self.bound, as an in-place write's would, and they view it again, so
        training, which reads and updates self.bound, goes on from them.
        Returns their indices. A new shape or dtype raises: the layout was
        planned at wrap."""
        rebound = []
        for i, (p, view, names) in enumerate(zip(self.params, self._param_views(self.bound, keep_views), self.names)):
            if guards.same_binding(p, view):
                continue
            if p.shape != view.shape or p.dtype != view.dtype:
                raise RuntimeError(
                    f"zerocore: {names[0]}.data was set to a tensor of shape {tuple(p.shape)} and dtype {p.dtype} "
                    f"after zerocore.wrap, which laid this param out as shape {tuple(view.shape)} and dtype "
                    f"{view.dtype}. To set its values, assign a tensor of that shape and dtype (`p.data = "
                    f"t.to({view.dtype})`) or write them in place (`p.copy_(t)` under torch.no_grad()); to change its "
                    "shape or dtype: model = engine.close(), change it, and wrap the model again.")
            values = p.detach()
            if values.untyped_storage().data_ptr() == view.untyped_storage().data_ptr():
                # It views the engine's buffer too (p.data = p.data.t()): copy_ must not read what it writes.
                values = values.clone()
            view.copy_(values)
            guards.restore(p, view)
            rebound.append(i)
        return rebound

    def unbind(self):
        """Sharded: the params point at placeholders with no memory again,
        and refuse writes (guards.release)."""
        for p, v, names in zip(self.params, self._placeholders, self.names):
            guards.release(p, v, names[0])
        self.bound = None

    # Gradients -------------------------------------------------------------
    def attach_grad_views(self):
        """Stages 0-1: each param's .grad is its view into the flat grad
        buffer, so autograd accumulates in place. The placeholder hide_grads
        left stands for the grads the buffer holds; a grad the user set to
        None counts as zero; one they replaced is taken over."""
        hidden = self._grad_placeholders or [None] * len(self.params)
        for i, (p, placeholder) in enumerate(zip(self.params, hidden)):
            view = self.grad_view(i)
            if p.grad is None:
                if not self._grads_zeroed:
                    view.zero_()
            elif p.grad is not placeholder and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view
        self._grads_zeroed = False

    def hide_grads(self):
        """After backward: each param's .grad becomes a placeholder that
        raises on use (guards.GradPlaceholder), since what autograd
        left there is not the grad the step applies."""
        if self._grad_placeholders is None:
            self._grad_placeholders = [guards.GradPlaceholder.of(p, self.stage, names[0])
                                       for p, names in zip(self.params, self.names)]
        for p, placeholder in zip(self.params, self._grad_placeholders):
            p.grad = placeholder

    def drop_hidden_grads(self):
        """.grad is None again where it is hide_grads' placeholder."""
        for p, placeholder in zip(self.params, self._grad_placeholders or ()):
            if p.grad is placeholder:
                p.grad = None

    def zero_grad(self):
        """Zeroes the grad buffers; the params' .grad are None."""
        self.store.zero_grads()
        for p in self.params:
            p.grad = None
        self._grads_zeroed = True

    def grad_view(self, index: int) -> torch.Tensor:
        """Stages 0-1: param `index`'s grad in the flat grad buffer, shaped as the param."""
        if self._grad_views is None:
            self._grad_views = [self._view("grad_full", "param", i).view(shape)
                                for i, shape in enumerate(self.shapes)]
        return self._grad_views[index]

    # The user's writes -----------------------------------------------------
    def note_param_versions(self):
        """The params' values as they are now are the engine's own (wrap's
        initialisation wrote through them too): writes through them from
        here on are the user's (carry_param_writes)."""
        self._versions = [p._version for p in self.params]

    def carry_param_writes(self):
        """Params held whole that the user wrote since the last call, in
        place (model.load_state_dict, p.fill_, nn.init.*) or by rebinding
        their .data (take_rebound): this rank's stretches of them go to the
        fp32 master, which the step updates and which would otherwise give
        the old values back. The params' version counters, which only
        writes through the param itself advance, tell which were written in
        place."""
        if self.sharded:
            return
        rebound = set(self.take_rebound())
        if "master" not in self.buffers:
            return
        for i, p in enumerate(self.params):
            if p._version != self._versions[i] or i in rebound:
                for seg in self.store.segments_of(i):
                    self._view("master", "segment", seg).copy_(self._view("full", "segment", seg))
                self._versions[i] = p._version

    def snapshot_partition(self) -> torch.Tensor:
        """This rank's partition of the params as they are now (write_back's `before`)."""
        out = torch.empty(self.partition_elems, dtype=self.dtype, device=self.bound.device)
        views.partition_from_flat(self.store, self.buckets, self.rank, self.bound, out)
        return out

    def write_back(self, before: torch.Tensor):
        """After the user edited params in place (gathered_params): carry the
        elements of this rank's blocks that changed into the shard and the
        fp32 master, leaving unchanged elements' master precision intact."""
        self.take_rebound(keep_views=not self.sharded)  # a sharded group's gathered buffer is a temporary
        now = torch.empty_like(before)
        views.partition_from_flat(self.store, self.buckets, self.rank, self.bound, now)
        changed = now != before
        if self.sharded:
            self.buffers["shard"].copy_(now)
        if "master" in self.buffers:
            self.buffers["master"][changed] = now[changed].float()
        self.note_param_versions()
