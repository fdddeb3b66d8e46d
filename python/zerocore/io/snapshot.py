"""In-memory snapshots with peer mirrors (Config(snapshot="memory"),
docs/snapshots.md): what each rank keeps after a step, and where.

After every snapshot_every-th completed step each rank copies what it owns
(a checkpoint's rank file: save_load.rank_tensors, its partition of the
fp32 params and optimizer states, its RNG states, rank 0 the module's
buffers), on the training thread, straight into the data of the file it
writes next, in shared memory that outlives the process. At the next
forward (where the loop has stepped its lr scheduler) the snapshot is
sealed with the checkpoint manifest of that step (step and loss scale
counters, hyperparameters, the named lr scheduler's state) and a
background thread checksums the data, writes the file's header and renames
it into place, then sends it to the rank's mirrors, the next
snapshot_copies nodes (mirror_offsets), each of which receives it
straight into a file of its own. The thread runs behind that forward and backward; the next
snapshot waits for it first, as does close.

The files, per node (Config.snapshot_dir, default /dev/shm/zerocore-snapshots):

    <dir>/<run id>/rank-HHHHH/g<gen>.step-<step>.rank-RRRRR-of-WWWWW.safetensors

held by rank H (its own, R == H, or a mirror of rank R's) of a world of W
ranks, generation <gen> (one more at each restore: files of a timeline
given up never mix with the one restored). Each is a checkpoint rank file
(io/checkpoint_format.py) whose header has room reserved, so that its data
can be written before its checksums. A file appears whole or not at all:
a rank keeps the two newest steps of each rank it holds, each file mapped
once, and writes over the older one under a temporary name, renamed into
place when whole, so a rank killed mid-write leaves the previous step
whole. Its checksums (one per tensor, one of the manifest) find any change
before anything is used (io/snapshot_restore.py).

The mirrors travel over a gloo process group of their own beside the data
group, so they never take a place in the order of the engine's queues
(comm/communicator.py): every rank's thread issues the same sends and receives, one
snapshot after another.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import socket
import threading
import weakref
import zlib

import torch
import torch.distributed as dist

from zerocore.io.checkpoint_format import crc32, rank_file_metadata
from zerocore.io.safetensors_file import plan
from zerocore.io.save_load import manifest_of, rank_tensors, set_hyperparameters

DEFAULT_DIR = "/dev/shm/zerocore-snapshots"
MANIFEST_KEY = "zerocore-snapshot"  # the step's checkpoint manifest, in each file's header
FILE = re.compile(r"g(\d+)\.step-(\d+)\.rank-(\d+)-of-(\d+)\.safetensors")
KEPT_STEPS = 2  # of each rank held: the newest whole while the next is written
_BACKEND_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a backend's buffers hold
HEAD_ROOM = 2  # a file's header gets room for twice the first one's size: its manifest may grow


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


def writes_behind(engine) -> bool:
    """Whether the engine's snapshots are written and mirrored by a thread
    behind its next forward and backward (Snapshots.seal): where its work
    runs on a device, so the training thread mostly waits for it."""
    return engine.device.type != "cpu"


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


def _runs(placed: list) -> list:
    """placed: (first byte in the file, tensor) in the file's order; the
    same, with tensors that follow on both in the file and in memory (a
    partition's stretches of one buffer do) made one, 1-D: a copy a run of
    them, not one a tensor."""
    runs = []
    for first, t in placed:
        if runs and t.is_contiguous() and t.numel():
            at, run = runs[-1]
            if (run.dim() == 1 and run.is_contiguous() and t.dtype == run.dtype and t.device == run.device
                    and first == at + run.numel() * run.element_size()
                    and t.untyped_storage().data_ptr() == run.untyped_storage().data_ptr()
                    and t.storage_offset() == run.storage_offset() + run.numel()):
                runs[-1] = (at, run.as_strided((run.numel() + t.numel(),), (1,)))
                continue
        runs.append((first, t.reshape(-1) if t.is_contiguous() else t))
    return runs


class _Files:
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


class Snapshots:
    """One engine's snapshots: taken after its steps (stepping), written
    and mirrored by a thread behind the next step. mirror_group: a gloo
    process group of the engine's ranks for the mirrors alone (None: a
    rank alone, no mirrors)."""

    def __init__(self, engine, mirror_group):
        cfg = engine.config
        self.engine = weakref.proxy(engine)  # the engine holds this, not the other way round
        self.every = cfg.snapshot_every
        self.rank, self.world_size = engine.comm.rank, engine.comm.world_size
        self.run = run_dir(cfg)
        self.dir = holder_dir(self.run, self.rank)
        os.makedirs(self.dir, exist_ok=True)
        self.offsets = mirror_offsets(engine.comm.gather_text(node_of(self.run)), cfg.snapshot_copies)
        self.group = mirror_group
        self.steps_done = 0  # completed optimizer steps (an fp16 overflow's skipped ones too)
        self.generation = 0
        self.lr_scheduler = None
        self.last_checkpoint = None  # the newest engine.save's folder, named when a partition is lost
        self.restored_lr_scheduler = None  # its state restored, until one is named (keep_lr_scheduler)
        self.restored_param_groups = None  # the optimizer's hyperparameters restored
        self.fetched = []  # the ranks whose files of the step restored came from other nodes
        self._own = _Files(self.dir, self.rank)
        self._mirrors = {k: _Files(self.dir, (self.rank - k) % self.world_size) for k in self.offsets}
        # The own file's layout: its tensors (key, dtype, shape), the room for its header, where each one's
        # data starts, its size.
        self._entries, self._head_bytes, self._placed, self._size = None, 0, None, 0
        self._unsealed = None  # the step whose snapshot was taken and not sealed yet
        self._thread = None
        self._error = None
        # The shared memory the snapshots hold on this rank: the files of its folder (its own, its mirrors', two
        # steps each).
        self.bytes_held = 0
        self._sealing = engine.module.register_forward_pre_hook(torch.compiler.disable(
            lambda *_: self.seal(), reason="zerocore: a snapshot is sealed and written outside any graph"))

    def step(self):
        """The engine's step, followed by a snapshot every `every` steps
        (the optimizer's step(): optim.drive_engine)."""
        applied = self.engine._step()
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
            set_hyperparameters(self.engine.optimizer, self.restored_param_groups)
            self.restored_lr_scheduler = None

    # Taking ------------------------------------------------------------------
    def take(self):
        """The snapshot of the step just completed: its tensors copied now
        into the data of the file written next; sealed (seal) before the
        next forward."""
        self.wait()
        self.engine.finish_update()  # a delayed offload update is part of the state
        tensors = rank_tensors(self.engine)
        entries = [(key, t.dtype, tuple(t.shape)) for key, t in tensors.items()]
        if entries != self._entries:
            self._entries = entries
            provisional = {key: 0xFFFFFFFF for key in tensors}  # a checksum's widest
            head, _ = plan(entries, rank_file_metadata(save_id(self.generation, self.steps_done, self.world_size),
                                                       self.rank, self.world_size, provisional,
                                                       self._manifest_metadata(self.steps_done)))
            self._lay_out(HEAD_ROOM * len(head))
        file = self._own.open(self._size)
        backend = self.engine.backend
        for first, t in _runs([(first, tensors[key].detach()) for (key, _, _), first in self._placed]):
            if t.dtype in _BACKEND_DTYPES:  # the engine's master and states (not the RNG's bytes, torch's own)
                # torch copies on the compute stream: the checking backend finds a read no wait orders after
                # the update that wrote it.
                backend.declare_access(backend.compute_stream(), t, "read", f"the snapshot of step {self.steps_done}")
            self._data(file, first, t.dtype, t.shape).copy_(t)
        self._unsealed = self.steps_done

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
        manifest = manifest_of(self.engine, save_id(self.generation, step, self.world_size), [0] * self.world_size,
                               scheduler, {"steps_done": step, "generation": self.generation,
                                           "last_checkpoint": self.last_checkpoint})
        text = json.dumps(manifest)
        return {MANIFEST_KEY: text, f"{MANIFEST_KEY}-crc32": str(manifest_crc(text))}

    def seal(self):
        """The snapshot taken at the last step gets its manifest and is
        written and mirrored: behind this forward and backward, by a
        thread, where the engine's work runs on a device; at once, on the
        training thread, where it runs on the CPU (a thread would take the
        training's own core, and its mirror's traffic beside the step's
        collectives cost more CPU than the mirror alone: bench/RESULTS.md).
        Not at the step itself: the loop steps its lr scheduler after the
        optimizer, which sets the lr of the step that follows, so the
        scheduler's state and the hyperparameters are read here, at the
        next forward (or wait)."""
        if self._unsealed is None:
            return
        step, self._unsealed = self._unsealed, None
        args = (step, self._manifest_metadata(step))
        if not writes_behind(self.engine):
            self._write_and_mirror(*args)
            self._raise_error()
            return
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
            self._seal_file(step, manifest_metadata)
            for k in self.offsets:
                self._mirror(step, k)
            prune(self.dir)
            self.bytes_held = sum(os.path.getsize(os.path.join(self.dir, f)) for f in os.listdir(self.dir))
        except BaseException as e:  # noqa: BLE001 - raised on the training thread at the next wait
            self._error = (step, e)

    def _seal_file(self, step, manifest_metadata):
        """The own file of `step`, its data written (take): checksummed,
        its header written, renamed into place."""
        file = self._own.open(self._size)
        crcs = {key: crc32(file[first:first + nbytes]) for key, first, nbytes in self._extents()}
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

    def _mirror(self, step, k):
        """This rank's newest file to rank + k, sent from its map; rank -
        k's received straight into the map of the older of the two files
        kept of it (_Files)."""
        dst, src = (self.rank + k) % self.world_size, (self.rank - k) % self.world_size
        outgoing = self._own.newest()
        incoming_size = torch.empty(1, dtype=torch.int64)
        self._exchange(torch.tensor([outgoing.numel()], dtype=torch.int64), dst, incoming_size, src, k)
        incoming = self._mirrors[k].open(int(incoming_size))
        self._exchange(outgoing, dst, incoming, src, k)
        self._mirrors[k].commit(file_name(self.generation, step, src, self.world_size))

    def _exchange(self, out, dst, into, src, tag):
        works = [dist.isend(out, group=self.group, group_dst=dst, tag=tag),
                 dist.irecv(into, group=self.group, group_src=src, tag=tag)]
        for w in works:
            w.wait()

    def close(self):
        self.wait()
        self._sealing.remove()
