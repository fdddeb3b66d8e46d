"""In-memory snapshots with peer mirrors (Config(snapshot="memory"),
docs/snapshots.md): what each rank keeps after a step, and where.

After every snapshot_every-th completed step each rank copies what it owns
(a checkpoint's rank file: save_load.rank_tensors, its partition of the
fp32 params and optimizer states, its RNG states, rank 0 the module's
buffers) into host memory of its own, on the training thread. At the next
forward (where the loop has stepped its lr scheduler) the snapshot is
sealed with the checkpoint manifest of that step (step and loss scale
counters, hyperparameters, the named lr scheduler's state) and a
background thread writes it as a checkpoint rank file, with its checksums,
into shared memory that outlives the process, then sends it to the rank's
mirrors, the next snapshot_copies ranks, each of which writes what it
received beside its own. The thread runs behind that forward and
backward; the next snapshot waits for it first, as does close.

The files, per node (Config.snapshot_dir, default /dev/shm/zerocore-snapshots):

    <dir>/<run id>/rank-HHHHH/g<gen>.step-<step>.rank-RRRRR-of-WWWWW.safetensors

held by rank H (its own, R == H, or a mirror of rank R's) of a world of W
ranks, generation <gen> (one more at each restore: files of a timeline
given up never mix with the one restored). A file appears whole or not at
all: it is written under a temporary name and renamed into place, and a
rank keeps the two newest steps of each rank it holds, so a rank killed
mid-write leaves the previous step whole. Its checksums (one per tensor,
one of the manifest) find any change before anything is used
(snapshot_restore.py).

The mirrors travel over a gloo process group of their own beside the data
group, so they never take a place in the order of the engine's queues
(comm.py): every rank's thread issues the same sends and receives, one
snapshot after another.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import threading
import weakref
import zlib

import torch
import torch.distributed as dist

from zerocore.checkpoint_format import write_rank_file
from zerocore.safetensors_file import tensor_bytes
from zerocore.save_load import manifest_of, rank_tensors, set_hyperparameters

DEFAULT_DIR = "/dev/shm/zerocore-snapshots"
MANIFEST_KEY = "zerocore-snapshot"  # the step's checkpoint manifest, in each file's header
FILE = re.compile(r"g(\d+)\.step-(\d+)\.rank-(\d+)-of-(\d+)\.safetensors")
KEPT_STEPS = 2  # of each rank held: the newest whole while the next is written


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


def holder_dir(run: str, rank: int) -> str:
    return os.path.join(run, f"rank-{rank:05d}")


def file_name(generation: int, step: int, rank: int, world_size: int) -> str:
    return f"g{generation:04d}.step-{step:012d}.rank-{rank:05d}-of-{world_size:05d}.safetensors"


def save_id(generation: int, step: int, world_size: int) -> str:
    """The checkpoint save id every rank's file of one snapshot carries."""
    return f"g{generation:04d}-s{step:012d}-w{world_size:05d}"


def manifest_crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _atomic_write(path: str, write):
    """write(tmp path), then the rename: `path` is whole or absent. The
    temporary file is the oldest of the rank's kept files in path's folder
    when it has KEPT_STEPS of them (the one the write would make prune
    remove), renamed: write overwrites it, reusing its pages; the newer
    ones stay whole meanwhile."""
    tmp = f"{path}.tmp.{os.getpid()}"
    oldest = _files_of(os.path.dirname(path), int(FILE.fullmatch(os.path.basename(path))[3]))[KEPT_STEPS - 1:]
    if oldest:
        with_errors_ignored(os.replace, os.path.join(os.path.dirname(path), oldest[0]), tmp)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


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


class Snapshots:
    """One engine's snapshots: taken after its steps (stepping), written
    and mirrored by a thread behind the next step. mirror_group: a gloo
    process group of the engine's ranks for the mirrors alone (None: a
    rank alone, no mirrors)."""

    def __init__(self, engine, mirror_group):
        cfg = engine.config
        self.engine = weakref.proxy(engine)  # the engine holds this, not the other way round
        self.every, self.copies = cfg.snapshot_every, min(cfg.snapshot_copies, engine.comm.world_size - 1)
        self.rank, self.world_size = engine.comm.rank, engine.comm.world_size
        self.run = run_dir(cfg)
        self.dir = holder_dir(self.run, self.rank)
        os.makedirs(self.dir, exist_ok=True)
        self.group = mirror_group
        self.steps_done = 0  # completed optimizer steps (an fp16 overflow's skipped ones too)
        self.generation = 0
        self.lr_scheduler = None
        self.last_checkpoint = None  # the newest engine.save's folder, named when a partition is lost
        self.restored_lr_scheduler = None  # its state restored, until one is named (keep_lr_scheduler)
        self.restored_param_groups = None  # the optimizer's hyperparameters restored
        self.fetched = []  # the ranks whose files of the step restored came from other nodes
        self._staged = {}
        self._incoming = {}  # k -> the buffer rank - k's file is received into
        self._unsealed = None  # the step whose snapshot was taken and not sealed yet
        self._thread = None
        self._error = None
        # Shared and own memory the snapshots hold on this rank: the files of
        # its folder (its own, its mirrors', two steps each), the staged copy and the mirrors' receive buffers.
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
        """The snapshot of the step just completed: its tensors copied here
        now; sealed (seal) before the next forward."""
        self.wait()
        self.engine.finish_update()  # a delayed offload update is part of the state
        tensors = rank_tensors(self.engine)
        if set(tensors) != set(self._staged) or any(self._staged[k].shape != t.shape or
                                                    self._staged[k].dtype != t.dtype for k, t in tensors.items()):
            self._staged = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in tensors.items()}
        for k, t in tensors.items():
            self._staged[k].copy_(t.detach())
        self._unsealed = self.steps_done

    def seal(self):
        """The snapshot taken at the last step gets its manifest and goes to
        the thread. Not at the step itself: the loop steps its lr scheduler
        after the optimizer, which sets the lr of the step that follows, so
        the scheduler's state and the hyperparameters are read here, at the
        next forward (or wait)."""
        if self._unsealed is None:
            return
        step, self._unsealed = self._unsealed, None
        sid = save_id(self.generation, step, self.world_size)
        scheduler = None if self.lr_scheduler is None else self.lr_scheduler.state_dict()
        manifest = manifest_of(self.engine, sid, [0] * self.world_size, scheduler,
                               {"steps_done": step, "generation": self.generation,
                                "last_checkpoint": self.last_checkpoint})
        text = json.dumps(manifest)
        meta = {MANIFEST_KEY: text, f"{MANIFEST_KEY}-crc32": str(manifest_crc(text))}
        self._thread = threading.Thread(target=self._write_and_mirror, args=(step, sid, meta),
                                        name="zerocore-snapshot", daemon=True)
        self._thread.start()

    def wait(self):
        """The snapshot taken is written and mirrored; its error, if any, raised."""
        self.seal()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"zerocore: the snapshot of step {error[0]} failed on rank {self.rank} "
                               f"({type(error[1]).__name__}: {error[1]})") from error[1]

    def _write_and_mirror(self, step, sid, meta):
        # Daemon: a process whose training ends by an error (a peer died)
        # exits without waiting for a mirror that will never come.
        try:
            path = os.path.join(self.dir, file_name(self.generation, step, self.rank, self.world_size))
            _atomic_write(path, lambda tmp: write_rank_file(tmp, sid, self.rank, self.world_size, self._staged,
                                                            metadata=meta, fsync=False, overwrite=True))
            for k in range(1, self.copies + 1):
                self._mirror(path, step, k)
            prune(self.dir)
            self.bytes_held = (sum(os.path.getsize(os.path.join(self.dir, f)) for f in os.listdir(self.dir)) +
                               sum(t.numel() * t.element_size() for t in (*self._staged.values(),
                                                                          *self._incoming.values())))
        except BaseException as e:  # noqa: BLE001 - raised on the training thread at the next wait
            self._error = (step, e)

    def _mirror(self, path, step, k):
        """This rank's file to rank + k, sent from its own pages (a memory
        map); rank - k's received into a buffer kept from one snapshot to
        the next, then written over the oldest mirror file (_atomic_write):
        in shared memory, cheaper than receiving into fresh pages."""
        dst, src = (self.rank + k) % self.world_size, (self.rank - k) % self.world_size
        with open(path, "rb") as f:
            outgoing = mapped(f, mmap.ACCESS_COPY)  # copy-on-write, never written: the file's pages
        size = torch.tensor([outgoing.numel()], dtype=torch.int64)
        incoming_size = torch.empty(1, dtype=torch.int64)
        self._exchange(size, dst, incoming_size, src, k)
        incoming = self._incoming.get(k)
        if incoming is None or incoming.numel() != int(incoming_size):
            incoming = self._incoming[k] = torch.empty(int(incoming_size), dtype=torch.uint8)
        self._exchange(outgoing, dst, incoming, src, k)

        def write(tmp):
            with open(tmp, "r+b" if os.path.exists(tmp) else "wb") as f:
                f.write(tensor_bytes(incoming))
                f.truncate()
        _atomic_write(os.path.join(self.dir, file_name(self.generation, step, src, self.world_size)), write)

    def _exchange(self, out, dst, into, src, tag):
        works = [dist.isend(out, group=self.group, group_dst=dst, tag=tag),
                 dist.irecv(into, group=self.group, group_src=src, tag=tag)]
        for w in works:
            w.wait()

    def close(self):
        self.wait()
        self._sealing.remove()
