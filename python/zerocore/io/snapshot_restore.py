"""Restoring the newest snapshot at a restart (Config(snapshot="memory"),
docs/snapshots.md; io/snapshot.py writes them).

At wrap, before the first step, the ranks:

1. list the snapshot files each sees on its node (one gather): every file
   is checked by one rank of its node, the lowest that sees it;
2. check them (every tensor's checksum, the manifest's, the names against
   the header) and share the verdicts (one gather), so that every rank
   holds the same table and picks the same step: the newest for which
   every rank of the world that took it has a whole file somewhere, its
   own or a mirror. A file that fails its checksums is refused, named in a
   warning on every rank, and never read;
3. make, each in a folder of its own, a view of that step as a checkpoint
   (io/checkpoint_format.py's layout) that lists the files it reads: those
   holding stretches of its partition (at another world size, the new
   one's), rank 0's (the buffers) and its own rank's (its RNG states). A
   file its node holds is linked; one it lacks comes from the rank that
   checked it, point to point over the snapshots' group. engine.load then
   reads the view, as it reads any checkpoint, with its checks and its
   agreement.

Where no step is whole (two nodes in a row lost with one copy), every rank
raises SnapshotLostError naming the ranks whose partition no survivor
holds and the newest disk checkpoint (engine.save) of the run. Where there
are no snapshots, nothing is restored: a first start.
"""
from __future__ import annotations

import json
import mmap
import os
import shutil
import warnings

import torch
import torch.distributed as dist

from zerocore.io import save_load
from zerocore.io.checkpoint_format import CheckpointError, crc32, open_rank_file, rank_file, write_manifest
from zerocore.io.snapshot import FILE, MANIFEST_KEY, manifest_crc, mapped, node_of, save_id, with_errors_ignored


class SnapshotLostError(RuntimeError):
    """No snapshot step is whole: some rank's partition is held nowhere.
    Raised on every rank at wrap."""


def _listing(run: str) -> list:
    """(holder folder, file name) of every snapshot file under `run`."""
    out = []
    if not os.path.isdir(run):
        return out
    for holder in sorted(os.listdir(run)):
        folder = os.path.join(run, holder)
        if holder.startswith("rank-") and os.path.isdir(folder):
            out += [(holder, name) for name in sorted(os.listdir(folder)) if FILE.fullmatch(name)]
    return out


def _check(path: str) -> tuple:
    """(problem, the file's manifest, its param stretches [name, first,
    numel]): problem "" when every checksum holds."""
    try:
        gen, step, rank, world = (int(x) for x in FILE.fullmatch(os.path.basename(path)).groups())
        reader, meta = open_rank_file(path)
        try:
            if meta["id"] != save_id(gen, step, world) or meta["rank"] != rank or meta["world_size"] != world:
                return f"{path}: its header is of another snapshot ({meta['id']}, rank {meta['rank']})", None, None
            text = reader.metadata.get(MANIFEST_KEY, "")
            if str(manifest_crc(text)) != reader.metadata.get(f"{MANIFEST_KEY}-crc32"):
                return f"{path}: checksum mismatch in its manifest", None, None
            for key, stored in meta["crc32"].items():
                if crc32(reader.get(key)) != stored:
                    return f"{path}: checksum mismatch in {key}", None, None
            stretches = [[*key[len("param/"):].rsplit("/", 1), shape.numel()]
                         for key, (_, shape, _) in reader.entries.items() if key.startswith("param/")]
            return "", json.loads(text), [[name, int(first), n] for name, first, n in stretches]
        finally:
            reader.close()
    except (CheckpointError, OSError, ValueError, KeyError) as e:
        return f"{path}: not a whole snapshot file ({type(e).__name__}: {e})", None, None


class _Table:
    """Every rank's view of the run's snapshot files, the same on every rank."""

    def __init__(self, comm, run):
        self.comm, self.run, self.host = comm, run, node_of(run)
        seen = [json.loads(t) for t in comm.gather_text(json.dumps({"host": self.host, "files": _listing(run)}))]
        self.hosts = [s["host"] for s in seen]
        # Each file of a node, checked by the lowest rank that sees it.
        self.checker = {}
        for r, s in enumerate(seen):
            for holder, name in s["files"]:
                self.checker.setdefault((s["host"], holder, name), r)
        mine = [(holder, name) for (host, holder, name), r in self.checker.items() if r == comm.rank]
        verdicts = [_check(os.path.join(run, holder, name)) + (holder, name) for holder, name in mine]
        self.manifest = {}  # (holder, name) -> manifest, on this rank, for the files it checked
        shared = []
        for problem, manifest, stretches, holder, name in verdicts:
            shared.append([holder, name, problem, (manifest or {}).get("extra", {}).get("last_checkpoint"),
                           stretches])
            if manifest is not None:
                self.manifest[(holder, name)] = manifest
        # (checking rank, holder folder, file name, problem, last checkpoint, param stretches) of every file.
        self.verdicts = [(r, *v) for r, text in enumerate(comm.gather_text(json.dumps(shared)))
                         for v in json.loads(text or "[]")]

    def whole(self) -> dict:
        """(step, generation, world size) -> {rank: [(checking rank, holder, name)]} of the whole files."""
        out = {}
        for r, holder, name, problem, *_ in self.verdicts:
            if not problem:
                gen, step, rank, world = (int(x) for x in FILE.fullmatch(name).groups())
                out.setdefault((step, gen, world), {}).setdefault(rank, []).append((r, holder, name))
        return out

    def refused(self) -> list:
        return [problem for _, _, _, problem, *_ in self.verdicts if problem]

    def last_checkpoint(self):
        """The disk checkpoint the newest file names (engine.save's folder), or None."""
        named = [(int(FILE.fullmatch(name)[2]), int(FILE.fullmatch(name)[1]), c)
                 for _, _, name, _, c, _ in self.verdicts if c]
        return max(named)[2] if named else None


def restore(snapshots) -> int:
    """Restores the newest whole snapshot step into the engine; returns the
    steps it holds (0: none). Call it on every rank, at wrap."""
    engine, comm = snapshots.engine, snapshots.engine.comm
    table = _Table(comm, snapshots.run)
    refused = table.refused()
    if refused:
        warnings.warn("zerocore: snapshot files refused (checksums; never read):\n  " + "\n  ".join(refused),
                      stacklevel=3)
    whole = table.whole()
    complete = sorted((key for key, ranks in whole.items() if set(ranks) >= set(range(key[2]))), reverse=True)
    if not complete:
        if table.verdicts:
            raise _lost(table, whole)
        return 0
    step, gen, world = complete[0]
    view = os.path.join(snapshots.run, f"restore-rank-{comm.rank:05d}")
    shutil.rmtree(view, ignore_errors=True)
    try:
        manifest = _assemble(table, snapshots.group, view, whole[(step, gen, world)], save_id(gen, step, world),
                             _needed(table, whole[(step, gen, world)], world, engine))
        extra = save_load.load(engine, view)
    finally:
        shutil.rmtree(view, ignore_errors=True)
    _forget_after(table, step)
    snapshots.generation = 1 + max(int(FILE.fullmatch(v[2]).group(1)) for v in table.verdicts)
    snapshots.steps_done = extra["steps_done"]
    snapshots.last_checkpoint = extra["last_checkpoint"]
    snapshots.restored_lr_scheduler = manifest["lr_scheduler"]
    snapshots.restored_param_groups = manifest["optimizer"]["param_groups"]
    snapshots.fetched = table.fetched
    return extra["steps_done"]


def _lost(table, whole) -> SnapshotLostError:
    step, gen, world = max(whole) if whole else max(
        (int(m[2]), int(m[1]), int(m[4])) for m in (FILE.fullmatch(v[2]) for v in table.verdicts))
    lost = sorted(set(range(world)) - set(whole.get((step, gen, world), {})))
    refused = table.refused()
    fallback = table.last_checkpoint()
    return SnapshotLostError(
        f"zerocore: no snapshot can be restored: the partitions of rank(s) {lost} (of {world}) at step {step} are "
        f"held nowhere, neither in their own snapshot folders nor in a peer's mirror"
        f"{' (the copies there failed their checksums: ' + '; '.join(refused) + ')' if refused else ''}, and no "
        f"older step is whole either. Fall back on the newest disk checkpoint: "
        f"{fallback + ' (engine.load)' if fallback else 'none was saved in this run (engine.save)'}; or remove "
        f"{table.run} to start afresh. More copies (Config(snapshot_copies=k)) survive k nodes lost.")


def _needed(table, ranks: dict, world: int, engine) -> list:
    """The files of the step this rank reads: those holding stretches of
    its partition (its plan's reads, as engine.load would make them), rank
    0's (the module's buffers) and its own rank's (its RNG states)."""
    held = {(r, holder, name): stretches for r, holder, name, problem, _, stretches in table.verdicts if not problem}
    wanted = {}
    for kind, name, first, n in save_load.plan_reads(engine)[1]:
        if kind == "param":
            wanted.setdefault(name, []).append((first, first + n))
    out = {0, table.comm.rank} & set(range(world))
    for origin, copies in ranks.items():
        if any(lo < first + n and first < hi for name, first, n in held[tuple(copies[0])]
               for lo, hi in wanted.get(name, ())):
            out.add(origin)
    return sorted(out)


def _assemble(table, group, view, ranks: dict, sid: str, needed: list) -> dict:
    """A view, in `view`, of the chosen step as a checkpoint that lists the
    files this rank reads (`needed`; the others None): links to the files
    its node holds, copies of the others, which their checking ranks send
    to the ranks that need and lack them (point to point, over the
    snapshots' group). Returns its manifest."""
    comm, world = table.comm, len(ranks)
    os.makedirs(os.path.join(view, sid))
    needs = [json.loads(t) for t in comm.gather_text(json.dumps(needed))]
    sends, receives = [], []  # (origin, peer, source or target path)
    for q, origins in enumerate(needs):
        for origin in origins:
            if any(table.hosts[r] == table.hosts[q] for r, _, _ in ranks[origin]):
                continue  # its node holds it
            sender, holder, name = ranks[origin][0]
            if sender == comm.rank:
                sends.append((origin, q, os.path.join(table.run, holder, name)))
            if q == comm.rank:
                receives.append((origin, sender, os.path.join(view, rank_file(sid, origin, world))))
    if (sends or receives) and group is None:
        raise RuntimeError("zerocore: a snapshot file this rank needs is on another node, and there is no group "
                           "to fetch it over")
    received = {origin for origin, _, _ in receives}
    for origin in needed:
        if origin not in received:
            r, holder, name = next(e for e in ranks[origin] if table.hosts[e[0]] == table.host)
            os.symlink(os.path.join(table.run, holder, name), os.path.join(view, rank_file(sid, origin, world)))
    _transfer(group, sends, receives)
    table.fetched = sorted(received)
    # The step's manifest, from rank 0's file, by the rank that checked it.
    sender, holder, name = ranks[0][0]
    texts = comm.gather_text(json.dumps(table.manifest[(holder, name)]) if sender == comm.rank else "")
    manifest = json.loads(texts[sender])
    manifest["files"] = [{"path": rank_file(sid, r, world),
                          "bytes": os.path.getsize(os.path.join(view, rank_file(sid, r, world)))}
                         if r in needed else None for r in range(world)]
    write_manifest(view, manifest)
    return manifest


def _transfer(group, sends, receives):
    """Each file of `sends` to its peer, each of `receives` from its peer
    into a file of its own (sizes first, then the bytes, file to file
    through memory maps), tagged by the rank whose file it is."""
    def exchange(outgoing, incoming):  # (peer, origin, tensor) each; the tensors live until all are done
        works = [dist.isend(t, group=group, group_dst=peer, tag=origin) for peer, origin, t in outgoing]
        works += [dist.irecv(t, group=group, group_src=peer, tag=origin) for peer, origin, t in incoming]
        for w in works:
            w.wait()

    sizes = {origin: torch.empty(1, dtype=torch.int64) for origin, _, _ in receives}
    exchange([(peer, origin, torch.tensor([os.path.getsize(source)])) for origin, peer, source in sends],
             [(peer, origin, sizes[origin]) for origin, peer, _ in receives])
    outgoing, incoming = [], []
    for origin, peer, source in sends:
        with open(source, "rb") as f:
            outgoing.append((peer, origin, mapped(f, mmap.ACCESS_COPY)))
    for origin, peer, target in receives:
        with open(target, "w+b") as f:
            f.truncate(int(sizes[origin]))
            incoming.append((peer, origin, mapped(f, mmap.ACCESS_WRITE)))
    exchange(outgoing, incoming)


def _forget_after(table, step: int):
    """Files of steps after the one restored belong to a timeline given up:
    each checking rank removes those it checked, and from its folders the
    files that dead writers left half-written (no rank writes before the
    first step, which every rank enters after its restore)."""
    comm = table.comm
    folders = set()
    for r, holder, name, *_ in table.verdicts:
        if r == comm.rank:
            folders.add(holder)
            if int(FILE.fullmatch(name).group(2)) > step:
                with_errors_ignored(os.remove, os.path.join(table.run, holder, name))
    for holder in folders:
        folder = os.path.join(table.run, holder)
        for name in os.listdir(folder):
            if ".tmp." in name:
                with_errors_ignored(os.remove, os.path.join(folder, name))
