"""Mutation testing of the suite: run on demand, not in CI (pytest does not
collect this file). Each mutation plants one bug that a rebuild of the
runtime could bring into a scratch copy of the repository (the working tree
as it is now, with the native module built here; a C++ mutation rebuilds
it), runs the fast tests meant to catch it, and reports whether they did
and which tests failed. docs/status.md has the last results.

    python tests/mutations.py                    # every mutation, after an unmutated run
    python tests/mutations.py skip-clipping ...  # some of them
    python tests/mutations.py --list
    python tests/mutations.py --check            # every anchor applies exactly once (seconds; CI)
    python tests/mutations.py --tests tests/test_engine_equivalence.py swap-buckets  # other tests

Run it from an environment where the tests run (torch, pytest; cmake and
ninja for the C++ mutations), with the native module built into
python/zerocore/. The scratch copy goes to a temporary directory and is
removed at the end (--keep keeps it).
"""
import argparse
import dataclasses
import glob
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The fast tests that compare training with a reference (about 2 minutes on 2 cores).
FAST = ("tests/test_mixed_precision.py", "tests/test_grad_scale.py", "tests/test_engine_equivalence.py")


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    edits: tuple  # (path, text, replacement): text must occur exactly once
    tests: tuple = FAST

    @property
    def native(self) -> bool:
        return any(path.startswith("cpp/") for path, _, _ in self.edits)


TRAINING = "python/zerocore/engine/training.py"
STEP = "cpp/src/step/zero_step.cpp"
GRAD_SCALE = "double grad_scale = 1.0 / ((options.exact ? 1 : parts_.data->world_size()) * loss_scale());"
# Stage 3's end-of-step round: the next forward's first units, gathered
# from the updated shards once the exchange's flags say which.
END_STEP = "  if (parts_.units != nullptr) parts_.units->end_step(agreed.unit_flags);"

MUTATIONS = [
    Mutation("drop-world-average", "grads summed over ranks, not averaged: the 1/world factor is lost",
             ((STEP, GRAD_SCALE, "double grad_scale = 1.0 / loss_scale();"),)),
    Mutation("average-accumulation",
             "accumulated grads scaled down by the backward calls: the engine's contract (and torch's, calling "
             "backward k times) is their sum, so a 1/accum factor is the bug here; the native step does not know "
             "the number of calls, so each call's loss is divided by its place in the step (1, 2, ...)",
             ((TRAINING, "(loss * self.parts.scaler.scale if self.parts.scaler.enabled else loss).backward()",
               "(loss * self.parts.scaler.scale / (self.progress.backward_calls + 1)).backward()"),)),
    Mutation("drop-accumulation", "each backward call drops the grads of the ones before it (only the last "
             "micro-batch counts)",
             ((TRAINING, "        self.parts.reducer.before_backward()\n",
               "        self.zero_grad()\n        self.parts.reducer.before_backward()\n"),)),
    Mutation("skip-unscale", "the loss scale is not divided out of the grads",
             ((STEP, GRAD_SCALE, "double grad_scale = 1.0 / (options.exact ? 1 : parts_.data->world_size());"),)),
    Mutation("round-master", "the fp32 master is rounded to the 16-bit dtype after each update",
             ((TRAINING, "        self.progress.step_count += applied\n",
               "        self.progress.step_count += applied\n        for g in self.parts.groups:\n"
               "            if \"master\" in g.buffers:\n"
               "                g.buffers[\"master\"].copy_(g.buffers[\"master\"].to(g.dtype))\n"),)),
    Mutation("stale-root-unit", "stage 3: the root unit's own buffer is never released, so it is gathered "
             "once and never again: forward and backward use its params from before the first step",
             (("cpp/src/schedule/gather_pool.cpp", "  if (p.residency == Residency::kReleased) return;\n",
               "  if (p.residency == Residency::kReleased || units_[size_t(unit)].own_slot) return;\n"),)),
    Mutation("prefetch-before-update", "stage 3: the next forward's units are gathered (end_step's prefetch) "
             "before the update, so the units it prefetches are a step stale",
             ((STEP, END_STEP + "  // the next forward's first units, updated\n", "  // moved before the update\n"),
              (STEP, "  const Exchanged agreed = take_grads(options.changes, !on_device);\n",
               "  const Exchanged agreed = take_grads(options.changes, !on_device);\n" + END_STEP + "\n"))),
    Mutation("swap-buckets", "stages 2-3: the reduced grads of a group's first two buckets land in each "
             "other's place in the grad partition",
             (("cpp/src/schedule/bucket_reducer.cpp",
               "group.buffer.slice(group.plan.partition_offset(b.bucket), shard);",
               "group.buffer.slice(group.plan.partition_offset(\n"
               "      b.bucket < 2 && group.plan.buckets().size() > 2 ? 1 - b.bucket : b.bucket), shard);"),)),
    Mutation("skip-clipping", "max_grad_norm is ignored",
             ((STEP, "  if (options.max_norm) grad_scale *=", "  if (false) grad_scale *="),),
             # With the older clipping test (AdamW, every step clipped), which a lost clip coefficient passes.
             FAST + ("tests/test_engine_models.py::test_gradient_clipping_by_global_norm",)),
    Mutation("flip-weight-decay", "weight decay grows the params instead of shrinking them (AdamW, Adam, SGD)",
             (("cpp/src/kernels/optim.cpp", "float(o.adamw ? 0.0 : o.weight_decay)", "float(o.adamw ? 0.0 : -o.weight_decay)"),
              ("cpp/src/kernels/optim.cpp", "float(o.adamw ? 1.0 - o.lr * o.weight_decay : 1.0)",
               "float(o.adamw ? 1.0 + o.lr * o.weight_decay : 1.0)"),
              ("cpp/src/kernels/optim.cpp", "return SgdCoefs{float(grad_scale), float(o.weight_decay),",
               "return SgdCoefs{float(grad_scale), float(-o.weight_decay),"))),
    Mutation("skip-overflow-check", "fp16: an inf/NaN grad is applied instead of skipping the step",
             ((STEP, "  out.applied = finite && !(options.exact && options.exact->regrid);", "  out.applied = true;"),)),
]


def _copy_tree(dest):
    """The working tree's files (tracked, and untracked ones git does not
    ignore) and the native module built into python/zerocore/."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    files += [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "python/zerocore/_native*.so"))]
    for rel in filter(None, files):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src) and not os.path.islink(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))


def applied(mutation, read) -> dict:
    """{path: source with the mutation's edits made, in order}, the sources
    from read(path); exits naming the mutation where an anchor does not
    occur exactly once (the code it targeted moved or changed)."""
    sources = {}
    for rel, text, replacement in mutation.edits:
        source = sources[rel] if rel in sources else read(rel)
        if source.count(text) != 1:
            raise SystemExit(f"mutations.py: {mutation.name}: {rel} holds {source.count(text)} copies of "
                             f"{text!r}; the mutation needs updating")
        sources[rel] = source.replace(text, replacement)
    return sources


def check(mutations) -> int:
    """Every mutation's anchors apply to the working tree, exactly once
    each; no build, no tests."""
    def read(rel):
        with open(os.path.join(ROOT, rel)) as f:
            return f.read()

    for m in mutations:
        applied(m, read)
    print(f"mutations.py: the anchors of all {len(mutations)} mutations apply")
    return 0


class Scratch:
    def __init__(self, path):
        self.path = path
        self.build = os.path.join(path, "_mutation_build")
        self.configured = False
        self.native = glob.glob(os.path.join(ROOT, "python/zerocore/_native*.so"))
        if not self.native:
            sys.exit("mutations.py: build the native module into python/zerocore/ first")

    def apply(self, mutation):
        originals = {}

        def read(rel):
            with open(os.path.join(self.path, rel)) as f:
                originals[rel] = f.read()
            return originals[rel]

        for rel, source in applied(mutation, read).items():
            with open(os.path.join(self.path, rel), "w") as f:
                f.write(source)
        return originals

    def revert(self, originals):
        for rel, source in originals.items():
            with open(os.path.join(self.path, rel), "w") as f:
                f.write(source)

    def build_native(self):
        """Rebuilds the native module from the scratch sources (incrementally
        after the first time) and puts it where the tests import it."""
        if not self.configured:
            subprocess.run(["cmake", "-S", self.path, "-B", self.build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                            "-DZEROCORE_PYTHON=ON", "-DZEROCORE_CUDA=OFF", "-DZEROCORE_BUILD_BENCH=OFF",
                            "-DZEROCORE_BUILD_TESTS=OFF", f"-DPython_EXECUTABLE={sys.executable}"],
                           check=True, capture_output=True)
            self.configured = True
        run = subprocess.run(["cmake", "--build", self.build], capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"mutations.py: the build failed:\n{run.stdout[-4000:]}{run.stderr[-4000:]}")
        built = glob.glob(os.path.join(self.build, "**", "_native*.so"), recursive=True)
        shutil.copy2(built[0], os.path.join(self.path, "python/zerocore", os.path.basename(built[0])))

    def restore_native(self):
        for so in self.native:
            shutil.copy2(so, os.path.join(self.path, "python/zerocore", os.path.basename(so)))

    def pytest(self, tests, timeout):
        """([(node id, message)] of the tests that failed or errored, the
        output's tail); None for the list when pytest ran into the timeout."""
        env = dict(os.environ, PYTHONPATH="python", COLUMNS="2000")  # whole messages in the summary
        try:
            run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *tests],
                                 cwd=self.path, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, "timed out"
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$", run.stdout, re.M)
        if run.returncode != 0 and not failed:  # collection errors, crashes
            failed = [(f"pytest exited with {run.returncode}", "")]
        return failed, run.stdout[-3000:]


def condense(failed) -> str:
    """The failed tests grouped by test function, with how many of its
    parametrizations failed and, where the message says (assert_moved_like),
    by what factor the closest of them missed its bound."""
    by_test = {}
    for node, message in failed:
        cases, misses = by_test.setdefault(node.split("[")[0].replace("tests/", ""), ([], []))
        cases.append(node)
        found = re.search(r"off by (\S+) of its movement \(bound (\S+)\)", message or "")
        if found:
            misses.append(float(found[1]) / float(found[2]))
    out = []
    for name, (cases, misses) in by_test.items():
        notes = [f"{len(cases)} cases"] if len(cases) > 1 else []
        if misses:
            notes.append("params inf/NaN" if min(misses) == math.inf else f"missed the bound {min(misses):.3g}x")
        out.append(name + (f" ({'; '.join(notes)})" if notes else ""))
    return ", ".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--check", action="store_true",
                        help="check that every mutation's anchors apply exactly once, and exit (no build, no tests)")
    parser.add_argument("--tests", action="append", metavar="TEST",
                        help="run this test (a file or node id; repeatable) for each mutation instead of its own")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy")
    parser.add_argument("--show", action="store_true", help="print every failing test and its message")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per pytest run")
    args = parser.parse_args()
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:24} {'C++ ' if m.native else 'Py  '} {m.what}")
        return 0
    if args.check:
        return check(MUTATIONS)
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutation(s): {', '.join(sorted(unknown))}")
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]

    path = tempfile.mkdtemp(prefix="zerocore-mutations-")
    rows = []
    try:
        _copy_tree(path)
        scratch = Scratch(path)
        if not args.no_baseline:
            tests = args.tests or sorted({t for m in chosen for t in m.tests})
            failed, tail = scratch.pytest(tests, args.timeout)
            if failed != []:
                print(tail)
                raise SystemExit(f"mutations.py: the unmutated tests fail ({failed}); fix that first")
            print("unmutated: the tests pass", flush=True)
        for m in chosen:
            start = time.time()
            originals = scratch.apply(m)
            try:
                if m.native:
                    scratch.build_native()
                failed, tail = scratch.pytest(args.tests or m.tests, args.timeout)
            finally:
                scratch.revert(originals)
                if m.native:
                    scratch.restore_native()
            caught = failed is None or bool(failed)
            by = "a hang (timed out)" if failed is None else condense(failed)
            rows.append((m, caught, by))
            if args.show:
                for node, message in failed or []:
                    print(f"    {node}: {message}")
            print(f"{m.name}: {'caught' if caught else 'MISSED'} in {time.time() - start:.0f}s"
                  f"{' by ' + by if caught else ''}", flush=True)
    finally:
        if args.keep:
            print(f"scratch copy kept in {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)
    print("\n| mutation | bug planted | caught | by |\n|---|---|---|---|")
    for m, caught, by in rows:
        print(f"| {m.name} ({'C++' if m.native else 'Python'}) | {m.what} | {'yes' if caught else '**no**'} | {by} |")
    return 0 if all(caught for _, caught, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
