"""In-memory snapshots with peer mirrors (Config(snapshot="memory"),
docs/snapshots.md): what each rank keeps after a step, and where.

After every snapshot_every-th completed step each rank copies what it owns
(a checkpoint's rank file: save_load.rank_tensors, its partition of the
fp32 params and optimizer states, its RNG states, rank 0 the module's
buffers), on the training thread, straight into the data of the file it
writes next, in shared memory that outlives the process
(snapshot_files.py: the files, their names, the two kept of each rank),
checksummed in the same pass where it is in host memory (CRC-32C, in
hardware where the CPU has it: checkpoint_format.copy_with_checksum). At
the next forward (where the loop has stepped its lr scheduler) the
snapshot is sealed with the checkpoint manifest of that step (step and loss
scale counters, hyperparameters, the named lr scheduler's state), by a
thread of its own at the lowest priority, behind that forward and
backward: the checksums not taken yet (a device's tensors, copied down)
computed, its header written, the file renamed into place, then sent to
its mirrors (snapshot_mirror.py: the next snapshot_copies nodes,
mirror_offsets; snapshot_transport.py: how the bytes travel). The thread
is waited for at the next snapshot. Its checksums (one per tensor, one of
the manifest) find any change before anything is used
(io/snapshot_restore.py).
"""
from __future__ import annotations

import json
import mmap
import os
import socket
import sys
import threading

import torch

from zerocore.io.checkpoint_format import checksum, copy_with_checksum, rank_file_metadata
from zerocore.io.safetensors_file import plan
from zerocore.io.save_load import manifest_of, rank_tensors, set_hyperparameters
from zerocore.io.snapshot_files import KeptFiles, file_name, holder_dir, manifest_crc, prune, runs, save_id
from zerocore.io.snapshot_mirror import Mirrors

DEFAULT_DIR = "/dev/shm/zerocore-snapshots"
MANIFEST_KEY = "zerocore-snapshot"  # the step's checkpoint manifest, in each file's header
_BACKEND_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a backend's buffers hold
HEAD_ROOM = 2  # a file's header gets room for twice the first one's size: its manifest may grow
BACKGROUND_NICE = 19  # the snapshots' thread's: the lowest priority (_yield_to_training)


def run_dir(config) -> str:
    """The folder of this run's snapshots on this node. A run id is needed:
    without one (torchrun's default rendezvous id is "none") every job
    would restore whatever an earlier job of the same model left."""
    run_id = config.snapshot_run_id or os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id == "none":
        raise ValueError("zerocore.wrap: Config(snapshot=\"memory\") needs the run's id, to restore this run's "
                         "snapshots and no other's: launch with torchrun --standalone or --rdzv-id=<id>, or set "
                         "Config(snapshot_run_id=...)")
    return os.path.join(config.snapshot_dir or DEFAULT_DIR, run_id)


def node_of(run: str) -> str:
    """The node a rank's snapshot folder is on: a host and the folder as it
    sees it (Config.snapshot_dir may differ by node)."""
    return f"{socket.gethostname()}:{os.path.realpath(run)}"


def mirror_offsets(nodes: list, copies: int) -> list:
    """How far after rank r its mirrors are (ranks r + offset, mod the
    world), given each rank's node: on the next `copies` nodes, at the
    same place in each (torchrun numbers a node's ranks in a row), so that
    a node lost takes no copy of its ranks' partitions with it. Where the
    nodes differ in size or their ranks are not in a row: the next ranks.
    On one node, none: a mirror there survives nothing its own file does not."""
    world, per_node = len(nodes), nodes.count(nodes[0])
    in_rows = (world % per_node == 0 and len(set(nodes)) == world // per_node
               and all(nodes[r] == nodes[r - r % per_node] for r in range(world)))
    stride = per_node if in_rows else 1
    if len(set(nodes)) == 1:
        return []
    return [k * stride for k in range(1, min(copies, world // stride - 1) + 1)]


def _yield_to_training():
    """The calling thread (the snapshots') at the lowest priority: where
    the training threads keep every core busy (the CPU bench) its work (the
    mirror's network stack above all) fills their waits rather than taking
    from their compute; where a core is to spare it changes nothing. At
    worst it is done when the next snapshot waits for it, as if inline.
    Linux only (a thread's own nice value)."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        except OSError:
            pass  # a sandbox that refuses it: the thread runs at the training's priority, the snapshot goes on


class Snapshots:
    """One engine's snapshots: taken after its steps (step), sealed and
    mirrored behind the next forward and backward (seal). The restores
    use parts.snapshot_group, a gloo process group of the engine's ranks
    for the snapshots alone; the mirrors parts.snapshot_transport
    (snapshot_transport.py; None: a rank alone, no mirrors)."""

    def __init__(self, parts, loop):
        cfg = parts.config
        self.parts, self.loop = parts, loop
        self.every = cfg.snapshot_every
        self.rank, self.world_size = parts.comm.rank, parts.comm.world_size
        self.run = run_dir(cfg)
        self.dir = holder_dir(self.run, self.rank)
        os.makedirs(self.dir, exist_ok=True)
        self.offsets = mirror_offsets(parts.comm.gather_text(node_of(self.run)), cfg.snapshot_copies)
        self.group = parts.snapshot_group
        self.steps_done = 0  # completed optimizer steps (an fp16 overflow's skipped ones too)
        self.generation = 0
        self.lr_scheduler = None
        self.last_checkpoint = None  # the newest engine.save's folder, named when a partition is lost
        self.restored_lr_scheduler = None  # its state restored, until one is named (keep_lr_scheduler)
        self.restored_param_groups = None  # the optimizer's hyperparameters restored
        self.fetched = []  # the ranks whose files of the step restored came from other nodes
        self._own = KeptFiles(self.dir, self.rank)
        self._mirrors = Mirrors(parts.snapshot_transport, self.rank, self.world_size, self.offsets, self.dir)
        # The own file's layout: its tensors (key, dtype, shape), the room for its header, where each one's
        # data starts, its size.
        self._entries, self._head_bytes, self._placed, self._size = None, 0, None, 0
        self._crcs = {}  # the checksums of the tensors taken, those copied from host memory (take)
        self._unsealed = None  # the step whose snapshot was taken and not sealed yet
        self._thread = None
        self._error = None
        # The shared memory the snapshots hold on this rank: the files of its folder (its own, its mirrors', two
        # steps each).
        self.bytes_held = 0
        self._sealing = parts.module.register_forward_pre_hook(torch.compiler.disable(
            lambda *_: self.seal(), reason="zerocore: a snapshot is sealed and written outside any graph"))

    def step(self):
        """The engine's step, followed by a snapshot every `every` steps
        (the optimizer's step(): optimizer_bridge.drive_engine)."""
        applied = self.loop.step()
        self.steps_done += 1
        if self.steps_done % self.every == 0:
            self.take()
        return applied

    def keep_lr_scheduler(self, lr_scheduler):
        """The snapshots keep its state; a restored one, if any, it takes now."""
        self.lr_scheduler = lr_scheduler
        if self.restored_lr_scheduler is not None:
            lr_scheduler.load_state_dict(self.restored_lr_scheduler)
            # A scheduler made after the restore (after wrap) set the lrs of its first step: the restored ones again.
            set_hyperparameters(self.parts.optimizer, self.restored_param_groups)
            self.restored_lr_scheduler = None

    # Taking ------------------------------------------------------------------
    def take(self):
        """The snapshot of the step just completed: its tensors copied now
        into the data of the file written next, those in host memory
        checksummed in the same pass; sealed (seal) at the next forward."""
        self.wait()
        self.loop.finish_update()  # a delayed offload update is part of the state
        tensors = rank_tensors(self.parts)
        entries = [(key, t.dtype, tuple(t.shape)) for key, t in tensors.items()]
        if entries != self._entries:
            self._entries = entries
            provisional = {key: 0xFFFFFFFF for key in tensors}  # a checksum's widest
            head, _ = plan(entries, rank_file_metadata(save_id(self.generation, self.steps_done, self.world_size),
                                                       self.rank, self.world_size, provisional,
                                                       self._manifest_metadata(self.steps_done)))
            self._lay_out(HEAD_ROOM * len(head))
        file = self._own.open(self._size)
        self._crcs, copied_by_torch = {}, []
        for (key, _, _), first in self._placed:
            t = tensors[key].detach()
            if t.device.type != "cpu" or not t.is_contiguous():
                copied_by_torch.append((first, t))  # copied below, a run at a time; checksummed at the seal
                continue
            self._declare_read(t)
            self._crcs[key] = copy_with_checksum(file[first:first + t.numel() * t.element_size()], t)
        for first, t in runs(copied_by_torch):
            self._declare_read(t)
            self._data(file, first, t.dtype, t.shape).copy_(t)
        self._unsealed = self.steps_done

    def _declare_read(self, t):
        if t.dtype in _BACKEND_DTYPES:  # the engine's master and states (not the RNG's bytes, torch's own)
            # The copy runs on the compute stream: the checking backend finds a read no wait orders after
            # the update that wrote it.
            backend = self.parts.backend
            backend.declare_access(backend.compute_stream(), t, "read", f"the snapshot of step {self.steps_done}")

    def _lay_out(self, head_bytes: int):
        """The own file's layout, with `head_bytes` (rounded up to a page) of room for its header."""
        self._head_bytes = -(-head_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        _, self._placed = plan(self._entries, None, self._head_bytes)
        self._size = max(first + nbytes for _, first, nbytes in self._extents())  # never empty: rng/cpu

    @staticmethod
    def _data(file, first, dtype, shape) -> torch.Tensor:
        """The tensor (dtype, shape) whose bytes start at byte `first` of the file."""
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        return file[first:first + nbytes].view(dtype).view(shape)

    def _manifest_metadata(self, step) -> dict:
        """The checkpoint manifest of `step`, with its checksum, as header metadata."""
        scheduler = None if self.lr_scheduler is None else self.lr_scheduler.state_dict()
        manifest = manifest_of(self.parts, self.loop.progress.step_count,
                               save_id(self.generation, step, self.world_size), [0] * self.world_size, scheduler,
                               {"steps_done": step, "generation": self.generation,
                                "last_checkpoint": self.last_checkpoint})
        text = json.dumps(manifest)
        return {MANIFEST_KEY: text, f"{MANIFEST_KEY}-crc32": str(manifest_crc(text))}

    def seal(self):
        """The snapshot taken at the last step gets its manifest and is
        written and mirrored behind this forward and backward, by a thread
        (the training thread only starts it; wait joins it). Not at the
        step itself: the loop steps its lr scheduler after the optimizer,
        which sets the lr of the step that follows, so the scheduler's
        state and the hyperparameters are read here, at the next forward
        (or wait)."""
        if self._unsealed is None:
            return
        step, self._unsealed = self._unsealed, None
        args = (step, self._manifest_metadata(step))
        self._thread = threading.Thread(target=self._write_and_mirror, args=args, name="zerocore-snapshot",
                                        daemon=True)
        self._thread.start()

    def wait(self):
        """The snapshot taken is written and mirrored; its error, if any, raised."""
        self.seal()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_error()

    def _raise_error(self):
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"zerocore: the snapshot of step {error[0]} failed on rank {self.rank} "
                               f"({type(error[1]).__name__}: {error[1]})") from error[1]

    def _write_and_mirror(self, step, manifest_metadata):
        # On a daemon thread: a process whose training ends by an error (a
        # peer died) exits without waiting for a mirror that will never come.
        try:
            _yield_to_training()
            self._seal_file(step, manifest_metadata)
            self._mirrors.send(self._own.newest(), self.generation, step)
            prune(self.dir)
            self.bytes_held = sum(os.path.getsize(os.path.join(self.dir, f)) for f in os.listdir(self.dir))
        except BaseException as e:  # noqa: BLE001 - raised on the training thread at the next wait
            self._error = (step, e)

    def _seal_file(self, step, manifest_metadata):
        """The own file of `step`, its data written (take): the checksums
        take left (a device's tensors) computed, its header written,
        renamed into place."""
        file = self._own.open(self._size)
        crcs = {key: self._crcs[key] if key in self._crcs else checksum(file[first:first + nbytes])
                for key, first, nbytes in self._extents()}
        sid = save_id(self.generation, step, self.world_size)
        metadata = rank_file_metadata(sid, self.rank, self.world_size, crcs, manifest_metadata)
        head, _ = plan(self._entries, metadata, self._head_bytes)
        if len(head) > self._head_bytes:  # the manifest outgrew its room: the data moves up, once
            data = file[self._head_bytes:].clone()
            self._lay_out(HEAD_ROOM * len(head))
            file = self._own.open(self._size)
            file[self._head_bytes:].copy_(data)
            head, _ = plan(self._entries, metadata, self._head_bytes)
        file[:len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        self._own.commit(file_name(self.generation, step, self.rank, self.world_size))

    def _extents(self):
        """(key, first byte, bytes) of each tensor of the own file."""
        return [(key, first, torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size())
                for (key, dtype, shape), first in self._placed]

    def close(self):
        self.wait()
        self._sealing.remove()
        self._mirrors.close()
