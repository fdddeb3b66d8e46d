"""Runs a function on N CPU ranks (gloo, fork start, a free loopback port)
and returns each rank's result. A rank that raises has its traceback
returned as a RankError; ranks still running at the deadline are killed and
reported as hung, so a deadlock fails the test instead of stalling it."""
import datetime
import faulthandler
import io
import multiprocessing
import os
import signal
import socket
import time
import traceback

import torch
import torch.distributed as dist


class RankError(Exception):
    def __init__(self, rank, exc_type, message, tb):
        super().__init__(f"rank {rank}: {exc_type}: {message}\n{tb}")
        self.rank, self.exc_type, self.message = rank, exc_type, message


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, queue):
    faulthandler.register(signal.SIGUSR1)  # the parent asks hung ranks for their stacks
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        torch.set_num_threads(1)
        result = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))


def run_ranks(fn, world, *args, timeout=60.0, raise_errors=True):
    """[result of rank 0, ..., rank world-1]; with raise_errors=False a
    failed rank's entry is its RankError."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(results) < world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                hung = sorted(set(range(world)) - set(results))
                for r in hung:
                    os.kill(procs[r].pid, signal.SIGUSR1)
                time.sleep(1)
                raise TimeoutError(f"rank(s) {hung} did not finish within {timeout}s (hang)")
            try:
                rank, status, payload = queue.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty
                continue
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                results[rank] = RankError(rank, *payload)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    out = [results[r] for r in range(world)]
    if raise_errors:
        for r in out:
            if isinstance(r, RankError):
                raise r
    return out
