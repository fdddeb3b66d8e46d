"""zerocore.wrap and the Engine it returns: a module trained with ZeRO.

The engine builds the model states from the plan (see flat_group.py for
where they live per stage) and the native schedule over them: the comm
queue (comm.py), gradient reduction (grad_reducer.py: BucketReducer, or the
step's BucketCollectives), stage 3's UnitSchedule (stage3.py) and the
post-step param all-gather; then it runs forward through the module,
backward through autograd with the hooks that drive that schedule, and
steps the partitioned native optimizer in one call.

torch.compile: the engine's own work runs eagerly, never traced
(torch.compiler.disable: dynamo must not trace native calls): the buffer
broadcast before the forward, backward, the step and zero_grad, and stage
3's hooks (stage3.py). The module's forward is compiled (in one graph at
stages 0-2, between the units' hooks at stage 3), and so is the backward of
what it compiled, through autograd as usual. (torch.compiler.disable imports
torch._dynamo with zerocore; building any torch.optim optimizer does too.)
"""
from __future__ import annotations

import contextlib
import hashlib
import math

import torch
import torch.distributed as dist
from torch import nn

from zerocore import _native, activation_checkpoint, devices, param_guards, save_load
from zerocore._native import BucketCollectives, UnitSchedule, ZeroStep
from zerocore.comm import KINDS, Communicator
from zerocore.config import Config
from zerocore.flat_group import NATIVE_NAMES, TORCH_DTYPES
from zerocore.grad_reducer import FullGradReducer, StagedReducer
from zerocore.grouping import build_groups, param_names
from zerocore.loss_scale import LossScaler, NonFiniteGradientError
from zerocore.materialize import IncompatibleKeys, Initializer, Loader
from zerocore.offload import OffloadUpdate, host_memory_problem
from zerocore.optim import drive_engine, read_optimizer, state_names
from zerocore.optim import release as release_optimizer
from zerocore.partition_update import InPlaceUpdate
from zerocore.placement import Placement
from zerocore.process_group import private_group
from zerocore.stage3 import UnitScheduler


def _own_group(group, timeout, backend=None):
    """A process group of the same ranks for the engine alone: its
    collectives run on native threads and may still be in flight when
    control returns to the user (a prefetch, a round), so they must never
    share a group with the user's own collectives. Its timeout: `timeout`
    (Config.timeout), or else `group`'s. Its backend: `backend`, or else
    the default's."""
    return None if group is None else private_group(group, timeout, backend)


def _default_group(group, placement, where):
    """The process group to train over: `group`, or the world's. A group
    whose backend cannot move the module's tensors (where.device's) raises
    here, alike on every rank, before any collective; a module wrap
    refuses (where.problem) raises on every rank once the ranks agree."""
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    if group is None:
        if placement.partitions_optimizer:
            raise ValueError(f"zerocore.wrap: stage {placement.stage} partitions across ranks and needs a process "
                             "group; call torch.distributed.init_process_group() first (or torchrun), or pass group=")
        problem = devices.missing_group_problem(where.device)
        if problem is not None:
            raise ValueError(problem)
        return None
    if where.problem is None:
        backend = dist.get_backend_config(group)
        problem = devices.group_problem(devices.device_types(backend), backend, where.device.type)
        if problem is not None:
            raise ValueError(problem)
    return group


def _model_problem(params, names, spec, where):
    """The error this rank's model or optimizer earns before wrapping, or
    None (meta params are the Initializer's to check). where: the
    devices.Decision."""
    if where.problem is not None:
        return ValueError(where.problem)
    bad = [names[id(p)][0] for p in params if not p.is_floating_point()]
    if bad:
        return TypeError(f"zerocore.wrap: parameter(s) {', '.join(bad)} are not floating point")
    opt_group = {id(p) for g in spec.param_groups for p in g["params"]}
    missing = [names[id(p)][0] for p in params if p.requires_grad and id(p) not in opt_group]
    if missing:
        return ValueError(f"zerocore.wrap: parameter(s) {', '.join(missing)} require grad but are not in the "
                          "optimizer; pass them to it or set requires_grad=False")
    unknown = [i for i, g in enumerate(spec.param_groups) for p in g["params"] if id(p) not in names]
    if unknown:
        return ValueError(f"zerocore.wrap: optimizer param group {unknown[0]} holds a tensor that is not a "
                          "parameter of this module")
    return None


# Why a graph breaks at the engine's calls: dynamo's error under fullgraph=True.
_BUFFERS = ("zerocore: engine.forward broadcasts the module's buffers from rank 0 eagerly, a graph break before the "
            "module runs; for fullgraph=True compile the module (model.compile(fullgraph=True)), not the engine")
_TRAINING = ("zerocore: engine.backward, step and zero_grad run eagerly (native collectives and hooks), graph breaks; "
             "for fullgraph=True compile the forward alone (torch.compile(engine) or model.compile()) and call "
             "them outside it: the backward of the compiled forward is compiled all the same")
_training = torch.compiler.disable(reason=_TRAINING)


def _hash(data: bytes, bits: int) -> int:
    """A hash of `data`, the same in every process (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> (64 - bits)


class Engine:
    def __init__(self, module, optimizer, config=None, *, group=None, units=None, init=None, backend=None):
        if not isinstance(module, nn.Module):
            raise TypeError(f"zerocore.wrap: expected a torch.nn.Module, got {type(module).__name__}")
        if getattr(module, "_zerocore_engine", None) is not None:
            raise ValueError("zerocore.wrap: this module is already wrapped; wrap the original module once")
        self.config = cfg = Config.from_any(config)
        self.placement = placement = Placement.of(cfg)
        spec = read_optimizer(optimizer)
        self.module = module
        params = list(module.parameters())
        names = param_names(module)
        # Where it trains, decided in one place: the device, and the native
        # backend every queue, store and pipeline of the engine runs on.
        where = devices.decide([(names[id(p)][0], p.device) for p in params] +
                               [(name, b.device) for name, b in module.named_buffers()], backend)
        self.device, self.backend = where.device, where.backend
        user_group = _default_group(group, placement, where)
        # The control plane (agreements, the step's exchange, stage 3's
        # rounds) runs on host groups beside the data group, so agreeing
        # never waits behind data collectives nor, with NCCL for data, makes
        # the GPU synchronise. Their queues are streams of the same backend.
        self.control = Communicator(_own_group(user_group, cfg.timeout, "gloo"), backend=self.backend) \
            if user_group is not None else None
        self.comm = Communicator(_own_group(user_group, cfg.timeout), fails_with=self.control, control=self.control,
                                 backend=self.backend)
        self.dtype = TORCH_DTYPES[cfg.dtype]
        self.reduce_dtype = TORCH_DTYPES[cfg.reduce_dtype]
        self.scaler = LossScaler(cfg.loss_scale, cfg.dtype)
        self.kind = spec.kind
        self.state_names = state_names(spec)
        self.step_count = 0

        initializer = Initializer(module, params, names, init)
        problem = _model_problem(params, names, spec, where) or initializer.problem
        self._check_same_model(spec, params, names, initializer, failed=problem is not None)
        if problem is not None:
            raise problem
        opt_group = {id(p): i for i, g in enumerate(spec.param_groups) for p in g["params"]}
        initializer.materialize()
        self.groups, self.units = build_groups(module, params, names, opt_group, config=cfg, placement=placement,
                                               dtype=self.dtype, reduce_dtype=self.reduce_dtype, comm=self.comm,
                                               state_names=self.state_names, units=units)
        self.comm.names.groups = [g.label for g in self.groups]  # errors name a collective's params
        self._allocate_agreeing()
        for g in self.groups:
            g.fill(initializer.values_later)
        self._fill_agreeing(initializer)
        for g in self.groups:
            g.note_param_versions()
        self.num_trainable_params = sum(p.numel() for p in params if p.requires_grad)
        # requires_grad as planned, checked at each backward (_note_trainability).
        self._planned_trainable = [(p, g.trainable, names[0]) for g in self.groups
                                   for p, names in zip(g.params, g.names)]
        # Stage 3: the root unit's trainable params, gathered once per backward (accounting.predicted_comm).
        self.root_numel = sum(s.numel for g in self.units[0].groups if g.trainable for s in g.slots) \
            if self.units else 0
        # Where this rank's partition is updated: one native call a step.
        self.update = OffloadUpdate(self.groups, placement, cfg, self.backend) if placement.optimizer_on_host \
            else InPlaceUpdate(self.groups)
        self.padding_elems = sum(g.plan.padding_elems for g in self.groups if g.trainable)
        # close() gives the buffers their dtype back.
        self._buffer_dtypes = {name: b.dtype for name, b in module.named_buffers(remove_duplicate=False)}
        self._cast_buffers(lambda _, b: self.dtype if b.is_floating_point() else b.dtype)

        # Stages 1-2: every rank's updated blocks into every rank's full params, in place.
        gathered = [g for g in self.groups if g.trainable and placement.partitions_optimizer and not g.sharded]
        self.param_gather = BucketCollectives(self.comm.queue, KINDS.index("all_gather"),
                                              [(g.tag, g.plan, g.full) for g in gathered]) if gathered else None
        self.scheduler = None
        if not placement.partitions_grads:
            self.reducer = FullGradReducer(self.groups, self.comm, placement)
        else:
            self.reducer = StagedReducer(self.groups, self.comm, self._staging_buffers(),
                                         on_request=placement.partitions_params)
        if placement.partitions_params:
            # The rounds run on a host group of their own, so that none waits
            # behind the data collectives queued before it, nor the step's
            # agreements behind a round in flight.
            self.rounds_comm = Communicator(_own_group(user_group, cfg.timeout, "gloo"), "stage 3's round",
                                            fails_with=self.comm, backend=self.backend)
            schedule = UnitSchedule(self.comm.queue, self.rounds_comm.queue, [u.native_spec() for u in self.units],
                                    NATIVE_NAMES[self.dtype], cfg.prefetch_bytes)
            # The rounds reduce each unit's trainable groups, by their places in the reduction order.
            self.reducer.reduce_in_rounds(schedule, [[self.reducer.index[id(g)] for g in u.groups if g.trainable]
                                                     for u in self.units])
            self.scheduler = UnitScheduler(self.units, schedule, self.backend, self._attach_unit_grads)
        # The step, in one native call: stages 0-1's reduction, the sum of
        # squares, the exchange (with stages 2-3's late grads), the decision
        # with the loss scaler, the update and the param gather or stage 3's
        # end-of-step round. Offload's host update (OffloadUpdate.host) runs
        # inside it too, between the decision and the gather.
        offload = placement.optimizer_on_host
        self.zero_step = ZeroStep(
            self.comm.queue, self.comm.control_queue, None if offload else self.update.runs,
            partitioned=placement.partitions_optimizer,
            grad_reduce=None if placement.partitions_grads else self.reducer.collectives,
            param_gather=self.param_gather, units=self.scheduler.native if self.scheduler else None,
            loss_scaler=self.scaler.native, host_update=self.update.host if offload else None)
        if placement.partitions_grads:
            self.reducer.late_grads_to(self.zero_step)
        # Stage 3: module.state_dict() and load_state_dict() refuse while params are released.
        self._state_guards = param_guards.guard_module_state(
            module, {id(p) for u in self.units for g in u.groups for p in g.params})
        # The user's optimizer drives the engine (optim.drive_engine); its
        # param_groups hold the hyperparameters every step reads.
        self.optimizer = optimizer
        drive_engine(optimizer, self._step, self.zero_grad)
        self._backward_calls = 0
        # Per step: the reduced grads' global squared norm once taken,
        # clip_grad_norm_'s bound, and trainability changes noted.
        self._forget_reduction()
        module._zerocore_engine = self

    # Construction ----------------------------------------------------------
    def _check_same_model(self, spec, params, names, initializer, failed):
        """Ranks compare a hash of config, optimizer, names, shapes,
        trainability and how params get their values before any other
        collective: a different model on one rank fails on every rank with
        this message instead of deadlocking. When every rank draws the
        initial values from its own RNG (meta params), the hash holds the
        RNG state too, since ranks that disagree on it would train different
        models. A rank that `failed` its own checks sends -1, so the others
        raise too instead of waiting for it in the next collective."""
        desc = repr((self.config, spec.kind, len(spec.param_groups), initializer.kind,
                     [(names[id(p)], tuple(p.shape), p.requires_grad) for p in params]))
        rng = _hash(bytes(torch.get_rng_state().tolist()), 31) if initializer.uses_rng else 0
        # One int64 a rank: the model's hash above the RNG's, to tell which differs.
        hashes = self.comm.gather_ints(-1 if failed else _hash(desc.encode(), 32) << 31 | rng)
        if failed:
            return
        rejected = [r for r, x in enumerate(hashes) if x == -1]
        if rejected:
            raise ValueError(f"zerocore.wrap: rank(s) {rejected} rejected the model (their error says why); "
                             "no rank wrapped it")
        odd = [r for r, x in enumerate(hashes) if x != hashes[0]]
        if odd and all(x >> 31 == hashes[0] >> 31 for x in hashes):
            raise ValueError(f"zerocore.wrap: the random number generators of rank(s) {odd} differ from rank 0's; "
                             "every rank initialises the meta-device params from its own CPU RNG, so seed every "
                             "rank alike (torch.manual_seed) before building the model and wrapping it, and draw "
                             "no random numbers on some ranks only in between")
        if odd:
            raise ValueError(f"zerocore.wrap: ranks disagree on the model, config or optimizer: rank(s) {odd} "
                             "differ from rank 0; every rank must wrap the same model with the same config")

    def _allocate_agreeing(self):
        """Every group's buffers, on every rank or on none: a host that
        cannot hold the offloaded states, or an allocation that fails on
        some rank, raises on every rank, naming the bytes, before the first
        broadcast of the params' values."""
        if self.placement.optimizer_on_host:
            problem = host_memory_problem(self.groups, self.comm)
            if problem is not None:
                raise problem
        error = None
        try:
            for g in self.groups:
                g.allocate()
        except MemoryError as e:
            need = {at: sum(g.planned_bytes(at) for g in self.groups) for at in ("device", "host")}
            error = MemoryError(f"zerocore.wrap: allocating this rank's model states failed ({need['device']:,} bytes "
                                f"where training runs and {need['host']:,} bytes on the host): {e}")
        self.comm.raise_together(error, "zerocore.wrap: allocating the model states failed on rank(s) {ranks} "
                                 "(their error names the bytes); no rank wrapped the model", MemoryError)

    def _fill_agreeing(self, initializer):
        """initializer.fill, on every rank; where it raises on some ranks
        (a user's init function, a file one rank cannot read), every rank
        raises, instead of the others waiting for it in the next collective."""
        if initializer.kind is None:
            return
        error = None
        try:
            initializer.fill(self._places())
        except Exception as e:  # noqa: BLE001 - re-raised below, after the ranks agree
            error = e
        self.comm.raise_together(error, "zerocore.wrap: initialising the params failed on rank(s) {ranks} (their "
                                 "error says why); no rank wrapped the model")

    def _places(self) -> dict:
        """id(param) -> (its flat group, its index there)."""
        return {id(p): (g, i) for g in self.groups for i, p in enumerate(g.params)}

    def _staging_buffers(self) -> int:
        """Staging buffers of gradient reduction planned at wrap: one in
        flight, plus the buckets open at once when grads arrive in about
        plan order. Stage 2: those one param spans, and one more for a
        neighbour that comes early (or the next bucket, which takes its
        staging for its grad views as the one before goes out). Stage 3,
        where a unit's buckets hold its grad views: the root's buckets (open all
        backward) and two of the largest other unit's, since a unit is
        reduced only once the ranks agree it is done, in the round the next
        unit's backward posts (settled one unit later); none for the
        reduction in flight: the unit whose first grad finds both taken
        completes it (BucketReducer) and takes its buffer, and until then the
        reduce-scatter runs behind the backward of the unit that followed it."""
        if not self.units:
            spans = [s.last_bucket - s.first_bucket + 1 for g in self.groups if g.trainable for s in g.slots]
            return 2 + max(spans, default=1)
        buckets = [sum(len(g.buckets) for g in u.groups if g.trainable) for u in self.units]
        return buckets[0] + 2 * max(buckets[1:], default=0)

    def _attach_unit_grads(self, unit):
        for g in unit.groups:
            if g.trainable:
                self.reducer.attach_grad_views(g)

    def _cast_buffers(self, dtype_of):
        """Each buffer to dtype_of(its name, the buffer)."""
        for mod_name, mod in self.module.named_modules():
            for name, b in list(mod.named_buffers(recurse=False)):
                dtype = None if b is None else dtype_of(f"{mod_name}.{name}" if mod_name else name, b)
                if dtype is not None and b.dtype != dtype:
                    setattr(mod, name, b.to(dtype))

    @torch.compiler.disable(reason=_BUFFERS)
    def _sync_buffers(self):
        """Every rank takes rank 0's buffers (running statistics...), as DDP does."""
        for b in self.module.buffers():
            self.comm.broadcast(b)

    # Training --------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Runs the module. Floating-point inputs are cast to the training
        dtype; buffers come from rank 0, as DDP does."""
        if next(self.module.buffers(), None) is not None:  # compiled, a model without buffers has no graph break
            self._sync_buffers()
        if self.dtype != torch.float32:
            cast = lambda x: x.to(self.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            args = torch.utils._pytree.tree_map(cast, args)
            kwargs = torch.utils._pytree.tree_map(cast, kwargs)
        failed = True
        try:
            out = self.module(*args, **kwargs)
            failed = False
            return out
        finally:
            if self.scheduler:
                self.scheduler.end_forward(failed)

    @_training
    def backward(self, loss: torch.Tensor):
        """loss.backward() with gradient reduction. Call it k times before
        step() to accumulate: grads sum over calls and average over ranks."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward: loss must be a scalar tensor")
        if self.placement.partitions_grads and getattr(torch._dynamo.compiled_autograd, "compiled_autograd_enabled",
                                                       False):
            hooks = "hand each grad to native reduction" + (" and gather units" if self.scheduler else "")
            raise RuntimeError(
                f"engine.backward: compiled autograd cannot run the backward of stage {self.placement.stage}, whose "
                f"hooks {hooks} as autograd goes, outside any graph. Leave compiled autograd off "
                "(torch._dynamo.config.compiled_autograd = False) for engine.backward: the backward of a compiled "
                "forward is compiled all the same")
        if self.zero_step.exchanged:
            raise RuntimeError("engine.backward: the grads of this step were already reduced (engine.clip_grad_norm_ "
                               "or a step that raised); call engine.step() or engine.zero_grad() first")
        self._note_trainability()
        self.reducer.before_backward()
        if self.scheduler:
            self.scheduler.begin_backward()
        failed = True
        try:
            (loss * self.scaler.scale if self.scaler.enabled else loss).backward()
            failed = False
        finally:
            try:
                if self.scheduler:  # first: its last round reduces the units' grads not reduced yet
                    self.scheduler.end_backward(failed)
            finally:
                self.reducer.after_backward()
        self._backward_calls += 1
        for g in self.groups:
            if g.trainable:
                g.hide_grads()

    @_training
    def step(self) -> bool:
        """Applies the accumulated gradients. Returns False when an fp16
        overflow on any rank skipped the step (on every rank)."""
        return self.optimizer.step()

    @_training
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips this step's grads to the global norm max_norm, as
        torch.nn.utils.clip_grad_norm_ does, and returns their global norm
        (over every param and rank, before clipping; inf or NaN when a grad
        is). Call it on every rank, between the last engine.backward() of a
        step and engine.step(), which applies the clipped grads. With
        Config(max_grad_norm) too, the smaller bound wins."""
        if norm_type != 2.0:
            raise ValueError(f"engine.clip_grad_norm_: norm_type={norm_type!r}; zerocore clips by the L2 norm "
                             "(norm_type=2.0)")
        if not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"engine.clip_grad_norm_: max_norm={max_norm!r}; use a positive number")
        norm = math.sqrt(self._reduce_grads()) / (self.comm.world_size * self.scaler.scale)
        self._clip_norm = max_norm if self._clip_norm is None else min(self._clip_norm, max_norm)
        return torch.tensor(norm, device=self.device)

    def _reduce_grads(self) -> float:
        """Reduces this step's grads across ranks, once a step, and returns
        their global sum of squares (of loss-scaled grads summed over ranks);
        raises if a param was frozen or unfrozen on any rank."""
        self._check_grads()
        total, changes = self._agreeing(lambda: self.zero_step.exchange(len(self._trainability_changed)))
        if changes:
            self._refuse_trainability_change()
        return total

    def _check_grads(self):
        if self._backward_calls == 0:
            raise RuntimeError("engine.step: no gradients; call engine.backward(loss) first")

    def _agreeing(self, call):
        """A native call of the step: its refusals (ranks that issued
        different collectives, a param frozen or unfrozen on some rank)
        become the errors that name what differed, on every rank."""
        if not self.zero_step.exchanged:  # this call takes the grads
            self.update.count_grads(self._backward_calls)
        try:
            return call()
        except _native.CollectiveOrderDiverged as e:
            trace = e.args[1]
        except _native.TrainabilityChanged:
            trace = None
        finally:
            self.update.follow_swaps()
        if trace is None:
            self._refuse_trainability_change()
        raise self.comm.order_error(trace)

    def _note_trainability(self):
        """Notes params whose requires_grad differs from the plan made at
        wrap; the step refuses them on every rank (_refuse_trainability_change)."""
        for p, trainable, name in self._planned_trainable:
            if p.requires_grad != trainable:
                self._trainability_changed.add(name)

    def _refuse_trainability_change(self):
        """A param was frozen or unfrozen after wrap, on some rank: every
        rank raises before anything is updated. The engine laid out and
        partitioned the trainable params at wrap, so it cannot train a param
        unfrozen since (its grads go nowhere) nor leave one frozen since as
        torch would (it would still get weight decay and moment updates)."""
        mine = sorted(self._trainability_changed)
        for p, trainable, _ in self._planned_trainable:
            if not trainable:
                p.grad = None  # grads autograd made for a frozen param unfrozen since
        here = (f"{', '.join(mine[:5])}{' and more' if len(mine) > 5 else ''} changed requires_grad" if mine
                else "another rank changed requires_grad of some params")
        raise RuntimeError(
            f"zerocore: {here} after zerocore.wrap; the engine plans which params train when it wraps the model, "
            "so this step would not train them as torch would. Nothing was updated. To change which params "
            "train: model = engine.close() (the trained params), set requires_grad, and wrap the model again "
            "(the optimizer's moments start afresh); or, to unfreeze a layer later without that, keep it "
            "trainable from the start in a param group of its own with lr=0 until it should train (a scheduler "
            "can raise it).")

    @_training
    def _step(self) -> bool:
        self._check_grads()
        bounds = [b for b in (self.config.max_grad_norm, self._clip_norm) if b is not None]
        self._carry_param_writes()
        try:
            applied, _, _ = self._agreeing(lambda: self.zero_step.step(
                self.kind, self.optimizer.param_groups, step=self.step_count + 1,
                max_norm=min(bounds) if bounds else None, changes=len(self._trainability_changed)))
        except NonFiniteGradientError:  # nothing was updated; a pending offload update lands
            self.finish_update()
            raise
        self.step_count += applied
        self._end_step()
        return applied

    def finish_update(self):
        """Offload with a delayed update: the update still running on the
        host finishes and its params go up (and, in stages 1-2, to every
        rank), so the module and the engine hold the latest params. Reading
        or saving the model calls it first; nothing to do otherwise. Call
        it on every rank. Before it, writes the user made to params held
        whole reach the fp32 masters (FlatGroup.carry_param_writes)."""
        self._carry_param_writes()
        if self.scheduler and self.placement.optimizer_on_host and self.update.pending:
            # Stage 3's end of step gathered the next forward's first units
            # from the shards the params up replace: they go (their gathers
            # done), and the next forward gathers the new params.
            self.scheduler.free_all()
        if self.update.params_up() and self.param_gather:
            self.param_gather.run()

    def _carry_param_writes(self):
        for g in self.groups:
            g.carry_param_writes()

    def _end_step(self):
        self._backward_calls = 0
        self._forget_reduction()
        if self.scheduler:
            self.scheduler.end_step()

    @_training
    def zero_grad(self):
        """Zeroes the grads (a step's reduced ones too, after a step that
        raised); every param's .grad is None."""
        for g in self.groups:
            g.zero_grad()
        self.reducer.drop_staged()
        self._forget_reduction()

    def _forget_reduction(self):
        """A new step begins: nothing of the last one's reduction applies."""
        self._clip_norm = None
        self.zero_step.forget()
        self._trainability_changed = set()  # names of this rank's params whose requires_grad changed

    # Inspection ------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def memory_report(self) -> dict:
        """Bytes of model states held on this rank: params, grads, optimizer
        states (fp32 master, moments), module buffers; plus the buffers
        collectives work in (comm_buffers: gradient reduction's staging, in
        stage 3 the pool units are gathered into, the step's exchange row,
        a few bytes of pinned host memory, and with offloaded grads the
        pinned buffer of one reduced shard they land in), which are not model
        states. Stage 3 params count their shard. All of it is allocated at
        wrap: the report is the same before the first step and after, except
        that stage 3's gather pool grows once (a slot, kept) when ranks need
        more units at the same time than planned (different experts on
        different ranks, units nested in units). "activations": the buffers
        zerocore.checkpoint keeps activation checkpoints in on this rank
        (allocated once, sized on the first step; 0 until it ends).
        "by_device": the same categories split by where they live:
        "device" (where training runs) and "host" (what offload moved there:
        Config.offload_optimizer/offload_params, zerocore.checkpoint's
        offload="cpu")."""
        by = {at: {"param": 0, "grad": 0, "optim": 0} for at in ("device", "host")}
        for at, counts in by.items():
            for g in self.groups:
                for k, v in g.memory(at).items():
                    counts[k] += v
        by["device"]["buffers"] = sum(b.numel() * b.element_size() for b in self.module.buffers())
        by["host"]["buffers"] = 0
        by["device"]["comm_buffers"] = getattr(self.reducer, "pool_bytes", 0) + \
            (self.scheduler.native.buffer_bytes if self.scheduler else 0)
        # The step's exchange row; the landing buffer of reduced grads bound for the host.
        by["host"]["comm_buffers"] = self.zero_step.buffer_bytes + getattr(self.reducer, "landing_bytes", 0)
        by["device"]["activations"] = activation_checkpoint.buffer_bytes(offloaded=False)
        by["host"]["activations"] = activation_checkpoint.buffer_bytes(offloaded=True)
        return {**{k: by["device"][k] + by["host"][k] for k in by["device"]}, "by_device": by}

    def comm_stats(self) -> dict:
        """Elements moved by each kind of collective ({"all_gather",
        "reduce_scatter", "all_reduce"}), each counted at its full,
        unpartitioned size, since wrap or the last reset_comm_stats(): reset
        before a step to measure one step (zerocore.accounting.predicted_comm
        gives the formula). Control traffic (the start-up model check, the
        step's norm exchange, buffer broadcasts) is not counted. With
        offload_optimizer, "offload" adds the bytes copied between the device
        and the host: {"grad_bytes_to_host", "param_bytes_to_device"}."""
        return {**self.comm.stats, **self.update.stats()}

    def reset_comm_stats(self):
        """Starts a new comm_stats() window at zero."""
        self.comm.reset_stats()
        self.update.reset_stats()

    def full_state_dict(self) -> dict:
        """Full fp32 params under every name the module gives them, and the
        module's buffers, on every rank; loadable by module.load_state_dict."""
        self.finish_update()
        self._sync_buffers()
        out = {}
        for g in self.groups:
            flat = g.full_fp32()
            for i, (p_names, shape) in enumerate(zip(g.names, g.shapes)):
                value = g.view(flat, "param", i).view(shape).clone()
                for name in p_names:
                    out[name] = value
        for name, b in self.module.named_buffers():
            out[name] = b.detach().clone()
        return {k: out[k] for k in param_guards.state_dict_keys(self.module)}

    # Checkpoints -------------------------------------------------------------
    def save(self, path, lr_scheduler=None, extra=None):
        """Saves a checkpoint into the folder `path` (docs/checkpoint.md):
        every rank writes its own partition of the fp32 params and optimizer
        states, its RNG states, and rank 0 the module's buffers, with the step
        count, the loss scale, the optimizer's hyperparameters and, when
        given, lr_scheduler.state_dict() and `extra` (anything JSON can
        hold: an epoch, a data position). Call it on every rank, between
        steps. The save replaces the one in `path` only once every rank's
        files are on disk: one that fails or dies leaves the last one whole."""
        save_load.save(self, path, lr_scheduler, extra)

    def load(self, path, lr_scheduler=None):
        """Loads a checkpoint saved at any world size and stage, in any
        training dtype, into this engine (and lr_scheduler, when given);
        returns the `extra` it was saved with. Every rank checks the files
        and checksums it will read, and the ranks agree, before anything
        changes: a missing, truncated, corrupt or mismatched checkpoint
        raises zerocore.CheckpointError on every rank, with the engine as
        it was. Call it on every rank, between steps."""
        return save_load.load(self, path, lr_scheduler)

    @contextlib.contextmanager
    def gathered_params(self):
        """Full params visible on the module (stage 3 gathers them; other
        stages hold them already). Edits made inside are kept: changed
        elements go to the shards and fp32 masters on exit."""
        self.finish_update()
        if self.scheduler:
            self.scheduler.gather_all()
        before = [g.snapshot_partition() for g in self.groups]
        try:
            yield self.module
        finally:
            for g, snap in zip(self.groups, before):
                g.write_back(snap)
            if self.scheduler:
                self.scheduler.free_all()

    # Loading ---------------------------------------------------------------
    def load_state_dict(self, source, strict=True) -> IncompatibleKeys:
        """Sets the params and buffers from `source`, a state_dict or the path
        of a safetensors file (full_state_dict's counterpart): on every rank
        what it holds, the full params or its shard, and the fp32 master,
        exactly the source's values; a file is read only where this rank
        holds params. Optimizer states are left as they are. Call it on every
        rank: the ranks check their sources first, and if any rank's does
        not fit (a missing or unexpected key, with strict; a shape that
        differs), every rank raises and nothing is changed.
        Returns the missing and unexpected keys, as Module.load_state_dict."""
        loader = Loader(source, self.module, list(self.module.parameters()), param_names(self.module),
                        where="engine.load_state_dict", what="the source", strict=strict)
        self.comm.raise_together(loader.problem, "engine.load_state_dict: the source does not fit the model on "
                                 "rank(s) {ranks} (their error says why); no rank loaded it. Give every rank the "
                                 "same source")
        self.finish_update()
        if self.scheduler:  # no gathered copy of the old values may outlive the load
            self.scheduler.free_all()
        loader.load(self._places())
        return IncompatibleKeys(loader.missing, loader.unexpected)

    # Ending ----------------------------------------------------------------
    def close(self) -> nn.Module:
        """Ends training with this engine and hands the module back as a plain
        torch module: its params hold the full fp32 values (full_state_dict's)
        in memory of their own, its buffers their own dtype again. What the
        engine made goes now, not at some later garbage collection: its
        hooks, native buffers and threads (its process groups stay with
        torch.distributed until destroy_process_group()). Call it on every
        rank (stage 3 gathers the params). The module may be wrapped again;
        the engine and engine.optimizer refuse any further use."""
        module, state = self.module, self.full_state_dict()
        for handles in (getattr(self.scheduler, "handles", []), self.reducer.hooks, self._state_guards):
            for h in handles:
                h.remove()
        for name, p in module.named_parameters():
            p.grad = None
            param_guards.restore(p, state[name])
        self._cast_buffers(lambda name, _: self._buffer_dtypes[name])  # rank 0's values since full_state_dict
        del module._zerocore_engine
        release_optimizer(self.optimizer)
        comms = [self.comm, self.rounds_comm if self.scheduler else None, self.control]
        for comm in filter(None, comms):  # what is in flight (stage 3's prefetch for the next forward) lands first
            comm.close()
        self.__dict__.clear()  # the native objects and buffers go
        self.__class__ = _ClosedEngine
        return module


class _ClosedEngine:
    """What an engine is after close()."""

    def __getattr__(self, name):
        raise RuntimeError(f"zerocore: engine.{name}: this engine was closed (engine.close()); wrap the module "
                           "again to go on training")

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)  # raises


def wrap(module, optimizer, config=None, *, group=None, units=None, init=None, backend=None) -> Engine:
    """Wraps `module` for ZeRO training with `optimizer`'s algorithm and
    hyperparameters. It takes the optimizer over: its step() and zero_grad()
    become the engine's, its param_groups hold the hyperparameters each step
    reads (schedulers on it apply), and engine.optimizer is the same object.

    config: a zerocore.Config or a dict of its fields.
    group: the torch.distributed process group (default: the world).
    units: stage 3: module classes or modules to gather as units (default:
        the children of the outermost ModuleList/Sequential containers).
    init: where params on the meta device (built inside zerocore.init())
        get their values, each rank materialising only what it holds:
        None, each module's reset_parameters(), with the values eager
        construction gives after the same seed (seed every rank alike); a
        function called on each module that holds meta params, as
        model.apply(fn) (init=model._init_weights); or a state_dict or the
        path of a safetensors file, which sets every param (meta or not)
        and the buffers it holds. zerocore/materialize.py says how.
    backend: the native backend the engine runs on (zerocore._native:
        CpuBackend, CheckingBackend, CudaBackend), for tests that check or
        compare backends; by default the module's device decides
        (zerocore/devices.py): the process's default backend on the CPU, a
        CudaBackend on a CUDA device. It must run the module's device.
    """
    return Engine(module, optimizer, config, group=group, units=units, init=init, backend=backend)
