"""What the benchmarks here share: their command line's common part, their
ranks started as fresh processes over gloo on loopback (each sends its
result back as one tagged line of JSON), their configurations run
interleaved, and the tail that prints ratios against targets, writes
--json and says which configurations failed.

A benchmark's script is both the driver and, run with --worker NAME, one
rank of one configuration (`dispatch`). The driver starts the ranks with
`worker_command` and `run_ranks`; a worker joins its group with
`init_group` and ends with `send_result`. A benchmark whose ranks share
the driver's set-up forks them instead (`fork_ranks`)."""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import traceback

import torch.multiprocessing as mp

RESULT_TAG = "BENCH_RESULT "


def parser(doc: str, configs=None, worker: bool = True) -> argparse.ArgumentParser:
    """An argument parser described by doc's first paragraph, showing each
    option's default; with configs, --configs (a comma-separated subset,
    all by default); with worker, the hidden options that make the script
    one rank of one configuration (--worker, --rank, --port)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    if configs:
        p.add_argument("--configs", default=",".join(configs), help="comma-separated subset of " + ",".join(configs))
    if worker:
        p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
        p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
        p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p


def dispatch(args, worker, drive) -> int:
    """A benchmark's main: one rank of one configuration when --worker
    names one, else the driver's exit status."""
    if args.worker:
        worker(args)
        return 0
    return drive(args)


def free_port() -> int:
    """A TCP port free on loopback now, for one run's ranks to meet at."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forked_rank(measure, rank, port, args, results):
    try:
        result = measure(rank, port, *args)
        if rank == 0:
            results.put(("ok", result))
    except BaseException:  # noqa: BLE001 - the driver reports it instead of waiting forever
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def fork_ranks(measure, world: int, *args):
    """measure(rank, port, *args) on `world` forked processes (port: a free
    one of 127.0.0.1 for their tcp:// init); returns what rank 0's returns.
    A rank that raises ends the run with its traceback."""
    port = free_port()
    ctx = mp.get_context("fork")
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=_forked_rank, args=(measure, r, port, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    status, result = results.get()
    for p in procs:
        p.join() if status == "ok" else p.kill()
    if status != "ok":
        sys.exit(result)
    return result


def worker_command(script: str, name: str, python: str = None) -> list:
    """The command that runs one rank of configuration `name` of script
    (run_ranks adds --rank), at a fresh port; python: another build's
    interpreter."""
    return [python or sys.executable, os.path.abspath(script), "--worker", name, "--port", str(free_port())]


def init_group(args, world: int, backend: str = "gloo", timeout=None):
    """Joins this worker (rank args.rank) to the run's process group at
    args.port on loopback; timeout: a timedelta, or torch's default."""
    import torch.distributed as dist

    extra = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=world,
                            **extra)
    return dist


def launcher_env(args, world: int) -> dict:
    """The variables torchrun would set for this worker, for a system that
    joins its group from them (DeepSpeed)."""
    return dict(RANK=str(args.rank), LOCAL_RANK=str(args.rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(args.port))


def torch_step(forward, opt, mark, device_type: str = "cpu", dtype=None):
    """A torch peer's training step on the example GPT, step(x, y) -> loss:
    forward (under autocast to dtype on device_type, given a dtype),
    backward, the optimizer's step and zero_grad, with mark(phase) after
    each ("fwd", "bwd", "opt", "zero_grad")."""
    import torch

    def step(x, y):
        with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
            loss = forward(x, y)["loss"]
        mark("fwd")
        loss.backward()
        mark("bwd")
        opt.step()
        mark("opt")
        opt.zero_grad(set_to_none=True)
        mark("zero_grad")
        return loss

    return step


def send_result(result: dict) -> None:
    """A worker's result, as the line run_ranks reads back."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def run_ranks(label: str, command: list, ranks: int, timeout: float, env: dict = None) -> list:
    """Runs `command --rank r` for each rank r in fresh processes (gloo over
    loopback); returns each rank's result (the dict its send_result line
    holds), or raises RuntimeError naming the rank that failed or the
    timeout. env: variables to add to this process's environment."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"), **(env or {}))
    procs = [subprocess.Popen(command + ["--rank", str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(ranks)]
    deadline = time.monotonic() + timeout + 60
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError(f"{label}: timed out after {timeout + 60:.0f}s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for r, (rc, out, err) in enumerate(outs):
        lines = [l for l in out.splitlines() if l.startswith(RESULT_TAG)]
        if rc != 0 or not lines:
            tail = "\n".join((err or out).strip().splitlines()[-25:])
            raise RuntimeError(f"{label}: rank {r} exited with {rc}\n{tail}")
        results.append(json.loads(lines[-1][len(RESULT_TAG):]))
    return results


def config_names(text: str, known) -> list:
    """The names in a comma-separated --configs; exits with status 2 naming any unknown one."""
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in known]
    if bad:
        print(f"error: unknown config(s) {bad}; use {', '.join(known)}", file=sys.stderr)
        raise SystemExit(2)
    return names


def run_interleaved(names, repeats: int, run, show) -> tuple:
    """run(name) for each config, `repeats` rounds, configs interleaved (a
    noisy neighbour hits them alike); show(rep, name, result) after each.
    A config that fails (RuntimeError) is reported and not run again.
    Returns ({name: [results]}, {name: error})."""
    runs, failed = {}, {}
    for rep in range(repeats):
        for name in names:
            if name in failed:
                continue
            try:
                res = run(name)
            except RuntimeError as e:
                failed[name] = str(e)
                print(f"  {name:<9} FAILED: {e}", flush=True)
                continue
            runs.setdefault(name, []).append(res)
            show(rep, name, res)
    return runs, failed


class Ratios:
    """The ratios a benchmark prints after its results, of one config's
    result to another's: against a target (PASS or MISS) or for
    information, labels padded to width. results: {config: result};
    missed: whether a target was missed."""

    def __init__(self, results: dict, width: int = 0):
        self.results = results
        self.width = width
        self.missed = False

    def _ratio(self, a: str, b: str, key):
        value = (lambda r: r[key]) if key else (lambda r: r)
        return value(self.results[a]) / value(self.results[b])

    def target(self, label: str, a: str, b: str, limit: float, key: str = None) -> None:
        """a's result over b's (their `key`, given one) against `<= limit`;
        n/a where either did not run."""
        missing = [c for c in (a, b) if c not in self.results]
        if missing:
            print(f"  {label:<{self.width}} n/a (missing {', '.join(missing)})")
            return
        ratio = self._ratio(a, b, key)
        self.missed |= ratio > limit
        print(f"  {label:<{self.width}} {ratio:6.3f}  (target <= {limit:g})  {'PASS' if ratio <= limit else 'MISS'}")

    def info(self, label: str, a: str, b: str, key: str = None) -> None:
        """a's result over b's, for information; nothing where either did not run."""
        if a in self.results and b in self.results:
            print(f"  {label:<{self.width}} {self._ratio(a, b, key):6.3f}  (info)")


def finish(args, failed: dict, results: dict) -> int:
    """A driver's tail: results (with the arguments) to --json when given,
    the configurations that failed named, and the exit status: 1 when any
    failed."""
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **results, "failed": failed}, f, indent=1)
    if failed:
        print(f"\n{len(failed)} configuration(s) failed: {', '.join(failed)}")
        return 1
    return 0
