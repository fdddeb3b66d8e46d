"""In-memory snapshots with peer mirrors (Config(snapshot="memory"),
docs/snapshots.md), under torchrun (python -m torch.distributed.run) on
gloo ranks: a rank killed with SIGKILL in step 5 (at a place drawn afresh
each run: its forward, backward, step, or the snapshot written behind it),
with its snapshot folder lost too, a second launch at fewer ranks, two
neighbours lost, a corrupt snapshot. Every job that finishes is compared,
bitwise, with an uninterrupted run of snapshot_job.train on dist_harness's
ranks without snapshots (the same reduction order: the same bits). The
runs share one set-up: the 4-rank run that dies and its 3-rank relaunch,
whose snapshots the last two cases copy and damage.
"""
import datetime
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

import snapshot_job
import zerocore
from dist_harness import run_ranks
from zerocore.io import snapshot, snapshot_files, snapshot_sockets, snapshot_transport
from zerocore.io.save_load import rank_tensors

STEPS = 7
JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "snapshot_job.py")
PLACES = ("forward", "backward", "step", "snapshot")


def _launch(tmp, ranks, run_id, *job_args, restarts=1, steps=STEPS):
    """The job under torchrun; (torchrun's exit code and output, each rank's report, its output folder)."""
    out = tmp / f"out-{run_id}-{len(list(tmp.glob(f'out-{run_id}-*')))}"
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               f"--max-restarts={restarts}", "--monitor-interval=0.2", JOB, "--steps", str(steps),
               "--dir", str(tmp / "shm"), "--run-id", run_id, "--out", str(out), *job_args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    reports = []
    for r in range(ranks):
        path = out / f"rank-{r}.json"
        assert path.exists(), f"rank {r} wrote no report:\n{output[-6000:]}"
        reports.append(json.loads(path.read_text()))
    return proc.returncode, output, reports, out


def _assert_bitwise(out, reference, output):
    assert (out / "params.pt").exists(), f"the job did not finish:\n{output[-6000:]}"
    got = torch.load(out / "params.pt")
    assert got.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(got[name], value), f"{name} differs from the uninterrupted run"


def _restored(reports, output, restart):
    """The step every rank restored (the same on each), after `restart` restarts."""
    assert [r.get("restart") for r in reports] == [restart] * len(reports), output[-6000:]
    steps = {r["restored_step"] for r in reports}
    assert len(steps) == 1, f"ranks restored different steps: {reports}"
    return steps.pop()


@pytest.fixture(scope="module")
def reference3():
    """3 ranks, STEPS steps, never interrupted."""
    return run_ranks(snapshot_job.train, 3, STEPS)[0][0]


def _reference_4_then_3(tmp, step):
    """4 ranks up to `step`, a checkpoint, loaded at 3 ranks, on to STEPS."""
    ckpt = str(tmp / f"ckpt-{step}")
    run_ranks(snapshot_job.train, 4, STEPS, (step, ckpt))
    return run_ranks(snapshot_job.train, 3, STEPS, None, (step, ckpt))[0][0]


@pytest.fixture(scope="module")
def relaunched(tmp_path_factory):
    """A 4-rank run (a disk checkpoint after step 2) whose rank 3 dies in
    step 5 with no restart, then the same run id at 3 ranks, each rank on a
    node of its own (rank 3's partition comes from the mirror on rank 0,
    and each rank fetches the files holding its new partition from the
    others): (tmp folder,
    its report, output and output folder, the step restored, the 4 -> 3
    reference)."""
    tmp = tmp_path_factory.mktemp("snapshots")
    code, output, _, first = _launch(tmp, 4, "shrink", "--kill", "3:5:step", "--save-at", "2", "--node-per-rank",
                                     restarts=0)
    assert code != 0, "the 4-rank run was to die"
    code, output, reports, out = _launch(tmp, 3, "shrink", "--node-per-rank")
    assert code == 0, output[-6000:]
    step = _restored(reports, output, 0)
    return tmp, reports, output, out, step, _reference_4_then_3(tmp, step), first / "checkpoint"


@pytest.mark.parametrize("lose_dir", [False, True], ids=["own-snapshot", "node-lost-peer-mirror"])
def test_killed_rank_restarts_and_finishes_bitwise(tmp_path, reference3, lose_dir):
    """Rank 1 killed with SIGKILL at a random place of step 5 (lose_dir: each
    rank on a node of its own, rank 1's snapshot folder gone with it, so its
    partition comes from rank 2's mirror, sent over the group); torchrun
    restarts every rank, which restore the newest step every partition has,
    at most the step in flight and the one before it lost, and finish equal
    to the uninterrupted run."""
    place = random.choice(PLACES)
    kill = f"1:{4 if place == 'snapshot' else 5}:{place}"  # step 4's snapshot is written during step 5
    code, output, reports, out = _launch(tmp_path, 3, "kill", "--kill", kill,
                                         *(["--lose-dir", "--node-per-rank"] if lose_dir else []))
    assert code == 0, f"killed at {place}:\n{output[-6000:]}"
    step = _restored(reports, output, 1)
    assert 3 <= step <= 4, f"killed at {place}: restored step {step}"
    if lose_dir:  # rank 1 held nothing: its own file came from rank 2's mirror, rank 0's from rank 0
        assert {0, 1} <= set(reports[1]["fetched"]), reports
    _assert_bitwise(out, reference3, output)
    for report in reports:  # memory_report counts the snapshots: two steps of its own partition (and a mirror's)
        memory = report["memory_report"]
        held = memory["by_device"]["host"]["snapshots"]
        assert memory["snapshots"] == held > (3 if lose_dir else 1.5) * (memory["param"] + memory["optim"])


def test_fewer_ranks_after_a_four_rank_run_died(relaunched):
    """The 3-rank launch resharded the 4-rank snapshots: equal to a 4-rank
    run loaded from a checkpoint at 3 ranks."""
    _, reports, output, out, step, reference, _ = relaunched
    assert 3 <= step <= 4
    assert any(r["fetched"] for r in reports), "no rank fetched a file from another node"
    _assert_bitwise(out, reference, output)


def _copy_run(tmp, run_id):
    """The relaunched run's snapshots, on every node, under another run id; [run folder of node r]."""
    for node in sorted((tmp / "shm").glob("node-*")):
        shutil.copytree(node / "shrink", node / run_id)
    return [tmp / "shm" / f"node-{r}" / run_id for r in range(3)]


def test_two_neighbours_lost_with_one_copy_raise_on_every_rank(relaunched):
    """Ranks 1 and 2's nodes gone: rank 1's snapshot and its one mirror
    (on rank 2) are lost; every rank raises at wrap naming rank 1 and the
    run's disk checkpoint."""
    tmp, *_, checkpoint = relaunched
    runs = _copy_run(tmp, "neighbours")
    shutil.rmtree(runs[1])
    shutil.rmtree(runs[2])
    code, output, reports, _ = _launch(tmp, 3, "neighbours", "--node-per-rank", restarts=0)
    assert code != 0
    for rank, report in enumerate(reports):
        assert "rank(s) [1] (of 3)" in report.get("error", ""), f"rank {rank}: {report}"
        assert str(checkpoint) in report["error"], report["error"]


def test_corrupt_snapshot_is_refused(relaunched):
    """One bit of rank 1's newest snapshot flipped, its mirror removed: the
    checksum refuses it (a warning names it), every rank restores the step
    before, and the job ends as the run it copies."""
    tmp, _, _, _, _, reference, _ = relaunched
    runs = _copy_run(tmp, "corrupt")
    newest = sorted((runs[1] / "rank-00001").glob("*.rank-00001-of-00003.safetensors"))[-1]
    data = bytearray(newest.read_bytes())
    data[-5] ^= 0x10
    newest.write_bytes(bytes(data))
    (runs[2] / "rank-00002" / newest.name).unlink()
    code, output, reports, out = _launch(tmp, 3, "corrupt", "--node-per-rank", restarts=0)
    assert code == 0, output[-6000:]
    assert _restored(reports, output, 0) == STEPS - 1
    assert f"{newest}: checksum mismatch" in output
    _assert_bitwise(out, reference, output)


@pytest.mark.parametrize("fields", [{"stage": 0}, {"stage": 1}, {"stage": 2, "dtype": "bf16"},
                                    {"stage": 3, "offload_optimizer": "cpu", "delayed_update": True,
                                     "delayed_update_warmup": 1}],
                         ids=["stage0", "stage1", "stage2-bf16", "stage3-offload-delayed"])
def test_restored_in_process_equals_the_uninterrupted_run(tmp_path, fields):
    """Without torchrun, on dist_harness's 2 ranks: a run of 3 steps with
    snapshots, then another wrap of the same run id restoring step 3 and
    going on to STEPS, equal bitwise to STEPS steps uninterrupted, at other
    stages, in bf16, and with the optimizer offloaded and its update
    delayed. That one's reference takes snapshots too: a snapshot lets the
    delayed update land first (as engine.save does), so the steps it
    follows are not delayed, and a run with snapshots is not one without."""
    _assert_restored_in_process(tmp_path, fields)


def _assert_restored_in_process(tmp_path, fields):
    snapshots = {"snapshot_dir": str(tmp_path), **fields, "snapshot": "memory", "snapshot_run_id": "r"}
    uninterrupted = {**snapshots, "snapshot_run_id": "other"} if fields.get("delayed_update") else \
        {k: v for k, v in fields.items() if not k.startswith("snapshot")}
    reference = run_ranks(snapshot_job.train, 2, STEPS, None, None, uninterrupted)[0][0]
    run_ranks(snapshot_job.train, 2, 3, None, None, snapshots)
    state, restored = run_ranks(snapshot_job.train, 2, STEPS, None, None, snapshots)[0]
    assert restored == 3
    for name, value in reference.items():
        assert torch.equal(state[name], value), f"{name} differs from the uninterrupted run"


def test_mirrored_through_the_staged_chunk_loop(tmp_path, monkeypatch):
    """The GPU's mirror transport (StagedTransport: chunks copied up into
    two device buffers, exchanged, copied down into the peer's file), its
    loop run here on the CPU with host buffers over the gloo group, in
    chunks of 4 KiB (a snapshot is hundreds of them, its last one short),
    each rank a node of its own: the restore is still the uninterrupted
    run, bitwise."""
    monkeypatch.setattr(snapshot_transport, "for_engine", lambda host_group, *_: snapshot_transport.StagedTransport(
        host_group, torch.device("cpu"), chunk_bytes=4096))
    _assert_restored_in_process(tmp_path, {"stage": 3, "snapshot_dir": str(tmp_path / "node-{rank}")})


def _exchanged_around_the_ring(rank, world, sizes, chunk, device):
    """Each rank's random bytes (sizes[rank] of them, drawn from seed
    rank) sent to rank + 1 while rank - 1's arrive, through the staged loop
    with its chunk buffers on `device` (test_gpu_ranks.py runs it on a GPU
    over NCCL), or over sockets (device None): what arrived."""
    group = torch.distributed.group.WORLD
    if device is None:
        transport = snapshot_sockets.SocketTransport(group)
    else:
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        transport = snapshot_transport.StagedTransport(group, device, chunk)
    mine = torch.randint(0, 256, (sizes[rank],), dtype=torch.uint8, generator=torch.Generator().manual_seed(rank))
    into = torch.zeros(sizes[(rank - 1) % world], dtype=torch.uint8)
    transport.exchange(mine, (rank + 1) % world, into, (rank - 1) % world)
    transport.close()
    return into


@pytest.mark.parametrize("device", ["cpu", None], ids=["staged", "sockets"])
def test_the_transports_move_every_byte(device):
    """3 ranks in a ring (each sends to one peer and receives from
    another), of sizes drawn afresh: more chunks than the other side, a
    chunk exactly, less than one, none; every byte arrives, in place,
    through the staged loop and over the sockets (megabytes: many sends
    and receipts each, both ways at once)."""
    assert_moved_around_the_ring(run_ranks, {}, device, chunk=1000 if device else 2**20)


def assert_moved_around_the_ring(run, options, device="cpu", chunk=1000):
    """_exchanged_around_the_ring on 3 ranks started by `run` (run_ranks,
    with `options`), of sizes in units of `chunk` drawn afresh, checked
    against each sender's bytes."""
    sizes = [random.randint(5 * chunk, 9 * chunk), chunk * random.randint(1, 3), random.choice([0, 17])]
    for rank, got in enumerate(run(_exchanged_around_the_ring, 3, sizes, chunk, device, **options)):
        src = (rank - 1) % 3
        want = torch.randint(0, 256, (sizes[src],), dtype=torch.uint8, generator=torch.Generator().manual_seed(src))
        assert torch.equal(got, want), f"rank {rank}: rank {src}'s bytes arrived changed"


def _mirror_with_a_peer_that_fails(rank, world, how):
    """Rank 0 exchanges a megabyte with rank 1 over the sockets (a 2 s
    timeout); rank 1 connects and closes ("closed"), connects and sends
    nothing ("stalled"), or never connects ("silent"): what rank 0's two
    exchanges raised."""
    transport = snapshot_sockets.SocketTransport(torch.distributed.group.WORLD, datetime.timedelta(seconds=2))
    if rank == 1:
        if how != "silent":
            transport._connection_to(0)
            transport._connection_from(0)
        if how == "closed":
            transport.close()
        time.sleep(4)  # past rank 0's timeout
        return None
    raised = []
    for _ in range(2):  # the second exchange raises the first one's failure again
        try:
            transport.exchange(torch.ones(2**20, dtype=torch.uint8), 1, torch.empty(2**20, dtype=torch.uint8), 1)
        except (ConnectionError, TimeoutError) as e:
            raised.append((type(e).__name__, str(e)))
    transport.close()
    return raised


@pytest.mark.parametrize("how, error", [("closed", ConnectionError), ("stalled", TimeoutError),
                                        ("silent", TimeoutError)])
def test_a_mirror_peer_that_fails_is_named_not_waited_for(how, error):
    """A peer that closes its connection mid-mirror, stops, or never makes one:
    the exchange raises (the snapshot's error, raised at the next one on
    the training thread), naming the rank, within the timeout; a later
    exchange raises it again rather than read a stream left mid-file."""
    start = time.monotonic()
    raised = run_ranks(_mirror_with_a_peer_that_fails, 2, how)[0]
    assert len(raised) == 2 and raised[0][0] == error.__name__ and "rank 1" in raised[0][1], raised
    assert raised[1][0] == "ConnectionError" and "earlier failure" in raised[1][1] and raised[0][1] in raised[1][1]
    assert time.monotonic() - start < 30


def test_the_mirror_sockets_listen_where_gloo_does(monkeypatch):
    """GLOO_SOCKET_IFNAME's interface's address (gloo's choice there too),
    and a clear error where it names none."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert snapshot_sockets.listening_address() == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-nic0")
    with pytest.raises(ValueError, match="GLOO_SOCKET_IFNAME names 'no-such-nic0'"):
        snapshot_sockets.listening_address()


def test_a_header_outgrowing_its_room_moves_the_data(tmp_path, monkeypatch):
    """A snapshot's data is written before its header, into room reserved
    at the first snapshot for twice that header: a manifest that grows
    past it (here 64 KiB more each step: past the room at step 3) moves the
    data up. The ranks, forked, take the padding along; the run restored
    from step 3's files is still the uninterrupted one, bitwise."""
    manifest_metadata = snapshot.Snapshots._manifest_metadata
    monkeypatch.setattr(snapshot.Snapshots, "_manifest_metadata",
                        lambda self, step: {**manifest_metadata(self, step), "padding": " " * (65536 * step)})
    _assert_restored_in_process(tmp_path, {"stage": 1})


def test_a_lost_node_of_two_ranks_is_restored_from_the_next_node(tmp_path):
    """4 ranks, two a node: each rank's mirror is on the next node (rank r's
    on rank r + 2), not its neighbour on its own node, so with node 1 (ranks
    2 and 3) lost both partitions come from node 0's mirrors; equal bitwise
    to the uninterrupted run."""
    reference = run_ranks(snapshot_job.train, 4, STEPS)[0][0]
    snapshots = {"snapshot": "memory", "snapshot_dir": str(tmp_path / "node-{pair}"), "snapshot_run_id": "r"}
    run_ranks(snapshot_job.train, 4, 3, None, None, snapshots)
    shutil.rmtree(tmp_path / "node-1")
    state, restored = run_ranks(snapshot_job.train, 4, STEPS, None, None, snapshots)[0]
    assert restored == 3
    for name, value in reference.items():
        assert torch.equal(state[name], value), f"{name} differs from the uninterrupted run"


def _snapshot_files_and_report(rank, world, folder):
    """3 steps with snapshots, each rank a node of its own: (its memory
    report, {file name: bytes} of its snapshot folder, the bytes of what it
    owns)."""
    model, opt = snapshot_job.model_and_optimizer()
    engine = zerocore.wrap(model, opt, snapshot_job.config(snapshot="memory", snapshot_run_id="r",
                                                           snapshot_dir=folder.format(rank=rank)))
    snapshot_job.run_steps(engine, snapshot_job.scheduler(opt), 1, 3)
    engine.snapshots.wait()
    held = engine.snapshots.dir
    files = {name: os.path.getsize(os.path.join(held, name)) for name in os.listdir(held)}
    owned = sum(t.numel() * t.element_size() for t in rank_tensors(engine.parts).values())
    report = engine.memory_report()
    engine.close()
    return report, files, owned


@pytest.mark.parametrize("staged", [False, True], ids=["host", "staged"])
def test_the_memory_report_counts_the_snapshot_and_the_mirror(tmp_path, monkeypatch, staged):
    """memory_report()["snapshots"] is every byte of the rank's snapshot
    folder (host memory: /dev/shm), the two newest files of its own and of
    the peer it mirrors, each what the rank owns plus a header; and, where
    the mirrors are staged through chunk buffers where the engine runs (a
    GPU's StagedTransport, here on the CPU with chunks of a size drawn
    afresh), those four buffers."""
    chunk = random.randint(1, 64) * 1024 if staged else 0
    if staged:
        monkeypatch.setattr(snapshot_transport, "for_engine", lambda host_group, *_: (
            snapshot_transport.StagedTransport(host_group, torch.device("cpu"), chunk_bytes=chunk)))
    for rank, (report, files, owned) in enumerate(run_ranks(_snapshot_files_and_report, 2,
                                                            str(tmp_path / "node-{rank}"))):
        host, device = report["by_device"]["host"]["snapshots"], report["by_device"]["device"]["snapshots"]
        assert host == sum(files.values()) and device == 4 * chunk and report["snapshots"] == host + device
        held = sorted((int(m[3]), int(m[2])) for m in map(snapshot_files.FILE.fullmatch, files))
        assert held == sorted([((rank + 1) % 2, 2), ((rank + 1) % 2, 3), (rank, 2), (rank, 3)]), files
        for name, size in files.items():  # the peer owns as much (an even split of this model)
            assert owned < size < owned + 65536, (name, size, owned)


@pytest.mark.parametrize("nodes, copies, offsets", [
    ("aabbcc", 1, [2]), ("aabbcc", 2, [2, 4]), ("aabbcc", 5, [2, 4]), ("abc", 1, [1]), ("abc", 3, [1, 2]),
    ("aaaa", 1, []), ("aab", 1, [1]), ("abab", 1, [1]), ("a", 1, [])])
def test_mirrors_go_to_the_next_nodes(nodes, copies, offsets):
    """Ranks in a row on equal nodes: at the same place on the next nodes;
    unequal or interleaved nodes: the next ranks; one node: none."""
    assert snapshot.mirror_offsets(list(nodes), copies) == offsets


def test_two_copies_survive_two_neighbours_lost(tmp_path, reference3):
    """snapshot_copies=2 on 3 ranks, each a node of its own: with ranks 1
    and 2's nodes lost, rank 1's partition is restored from its second
    mirror, on rank 0, and rank 2's from its first; equal bitwise to the
    uninterrupted run."""
    snapshots = {"snapshot": "memory", "snapshot_copies": 2, "snapshot_dir": str(tmp_path / "node-{rank}"),
                 "snapshot_run_id": "r"}
    run_ranks(snapshot_job.train, 3, 3, None, None, snapshots)
    for lost in (1, 2):
        shutil.rmtree(tmp_path / f"node-{lost}")
    state, restored = run_ranks(snapshot_job.train, 3, STEPS, None, None, snapshots)[0]
    assert restored == 3
    for name, value in reference3.items():
        assert torch.equal(state[name], value), f"{name} differs from the uninterrupted run"


@pytest.mark.parametrize("fields, named", [({"snapshot": "disk"}, "snapshot='disk'"),
                                           ({"snapshot": "memory", "snapshot_every": 0}, "snapshot_every=0"),
                                           ({"snapshot": "memory", "snapshot_copies": 0}, "snapshot_copies=0"),
                                           ({"snapshot": "memory", "snapshot_dir": ""}, "snapshot_dir=''")])
def test_config_refuses_bad_snapshot_fields(fields, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        zerocore.Config(**fields)


def test_snapshots_need_a_run_id(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    model, opt = snapshot_job.model_and_optimizer()
    with pytest.raises(ValueError, match="needs the run's id"):
        zerocore.wrap(model, opt, {"stage": 0, "snapshot": "memory"})


def test_naming_a_scheduler_needs_snapshots():
    model, opt = snapshot_job.model_and_optimizer()
    engine = zerocore.wrap(model, opt, {"stage": 0})
    with pytest.raises(ValueError, match="takes no snapshots"):
        engine.snapshot_lr_scheduler(snapshot_job.scheduler(opt))
