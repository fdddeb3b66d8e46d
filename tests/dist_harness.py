"""Runs a function on N ranks (gloo; fork start, or spawn for ranks that
use CUDA, which a forked child cannot) and returns each rank's result. The ranks meet through a FileStore in a fresh temporary directory,
so no two runs can collide (gloo's own sockets bind port 0 themselves).
Each rank's stdout and stderr (fds 1 and 2, Python's and native code's) go
to a file of its own, echoed after the run and quoted in any failure.

A rank that raises has its traceback returned as a RankError. A rank that
dies without a result (a signal, os._exit, a crash in native code) is
reported at once as a RankCrash naming its exit code or signal. Ranks still
running at the deadline are asked for their Python stacks (SIGUSR1) and
reported as hung (TimeoutError), so a deadlock fails the test instead of
stalling it."""
import datetime
import faulthandler
import io
import multiprocessing
import os
import queue as queue_module
import signal
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

OUTPUT_HEAD, OUTPUT_TAIL = 2000, 6000  # bytes of a rank's output quoted in a failure


class RankError(Exception):
    def __init__(self, rank, exc_type, message, tb):
        super().__init__(f"rank {rank}: {exc_type}: {message}\n{tb}")
        self.rank, self.exc_type, self.message = rank, exc_type, message


class RankCrash(Exception):
    """A rank that ended without a result: ``exitcode`` is its exit status,
    or minus the signal that killed it (as multiprocessing reports it)."""

    def __init__(self, rank, exitcode, output):
        how = (f"killed by {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exited with code {exitcode}")
        super().__init__(f"rank {rank} crashed: {how} without a result\n"
                         f"--- rank {rank} output ---\n{output}")
        self.rank, self.exitcode, self.output = rank, exitcode, output


def _redirect_output(path):
    """This process's fds 1 and 2, and Python's sys.stdout/stderr (under
    pytest they write to its capture file, not to fd 1), into `path`; crash
    and SIGUSR1 stack dumps too."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    faulthandler.enable(file=sys.stderr)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr)  # the parent asks hung ranks for their stacks


def _worker(rank, world, store_path, log_path, fn, args, queue, group):
    _redirect_output(log_path)
    try:
        store = dist.FileStore(store_path, world)
        # gloo moves CUDA tensors too (through pinned host memory): several ranks on one GPU train over it.
        dist.init_process_group(group, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        torch.set_num_threads(1)
        result = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))


def _output(path, head=OUTPUT_HEAD, tail=OUTPUT_TAIL):
    """A rank's output: its start and its end when it is long (what it printed
    first, and the stack it died or hung in)."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError:
        return ""
    if len(text) > head + tail:
        text = text[:head] + b"\n[... %d bytes ...]\n" % (len(text) - head - tail) + text[len(text) - tail:]
    return text.decode(errors="replace")


def run_ranks(fn, world, *args, timeout=60.0, raise_errors=True, start="fork", group="gloo"):
    """[result of rank 0, ..., rank world-1]; with raise_errors=False a
    failed rank's entry is its RankError. A crashed rank raises RankCrash
    and a hung one TimeoutError, whatever raise_errors says. start: the
    ranks' start method, "fork", or "spawn" (fresh interpreters: fn and
    args are pickled, so fn must be a module-level function) for ranks
    that use CUDA. group: the default process group's backend
    (init_process_group's), e.g. "cpu:gloo,cuda:nccl" for NCCL."""
    ctx = multiprocessing.get_context(start)
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="zerocore-ranks-") as tmp:
        logs = [os.path.join(tmp, f"rank{r}.log") for r in range(world)]
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, world, os.path.join(tmp, "store"), logs[r], fn, args, queue, group))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            results = _collect(procs, queue, logs, timeout)
        except BaseException:
            for p in procs:  # hung, crashed or interrupted: the others would only wait for it
                p.kill()
            raise
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            for r, log in enumerate(logs):  # shown by pytest with the test's output
                text = _output(log, 1 << 20, 0)
                if text:
                    print(f"--- rank {r} output ---\n{text}", end="" if text.endswith("\n") else "\n")
    out = [results[r] for r in range(world)]
    if raise_errors:
        for r in out:
            if isinstance(r, RankError):
                raise r
    return out


def _collect(procs, queue, logs, timeout):
    world = len(procs)
    results = {}

    def receive(wait):
        rank, status, payload = queue.get(timeout=wait)
        if status == "ok":
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            results[rank] = RankError(rank, *payload)

    deadline = time.monotonic() + timeout
    while len(results) < world:
        left = deadline - time.monotonic()
        if left <= 0:
            hung = sorted(set(range(world)) - set(results))
            for r in hung:
                if procs[r].is_alive():
                    os.kill(procs[r].pid, signal.SIGUSR1)
            time.sleep(1)  # time to write the stacks
            outputs = "".join(f"\n--- rank {r} output ---\n{_output(logs[r])}"
                              for r in hung)
            raise TimeoutError(f"rank(s) {hung} did not finish within {timeout}s (hang){outputs}")
        try:
            receive(min(left, 0.2))
            continue
        except queue_module.Empty:
            pass
        for r, p in enumerate(procs):
            if r not in results and p.exitcode is not None:
                # A rank's result is in the pipe before its process exits: take what is there first.
                try:
                    while r not in results:
                        receive(0.5)
                except queue_module.Empty:
                    raise RankCrash(r, p.exitcode, _output(logs[r])) from None
    return results
