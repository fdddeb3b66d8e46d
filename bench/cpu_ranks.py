"""CPU benchmarks' ranks: forked processes that meet over gloo on loopback."""
from __future__ import annotations

import socket
import sys
import traceback

import torch.multiprocessing as mp


def _rank(measure, rank, port, args, results):
    try:
        result = measure(rank, port, *args)
        if rank == 0:
            results.put(("ok", result))
    except BaseException:  # noqa: BLE001 - the parent reports it instead of waiting forever
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def run(measure, world, *args):
    """measure(rank, port, *args) on `world` forked processes (port: a free
    one of 127.0.0.1 for their tcp:// init); returns what rank 0's returns.
    A rank that raises ends the run with its traceback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(measure, r, port, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    status, result = results.get()
    for p in procs:
        p.join() if status == "ok" else p.kill()
    if status != "ok":
        sys.exit(result)
    return result
