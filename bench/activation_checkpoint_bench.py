"""Activation-checkpoint benchmark: no checkpointing, torch.utils.checkpoint,
zerocore.checkpoint partitioned over the model-parallel group (Pa) and
partitioned on the host (Pa+cpu), on the tensor-parallel GPT of
zerocore/examples/tp_gpt.py, on CPU ranks (gloo).

    python bench/activation_checkpoint_bench.py                 # 2 ranks: TP=2
    python bench/activation_checkpoint_bench.py --ranks 4 --steps 10

Every rank is one tensor-parallel rank of one group (MP = --ranks). Each
configuration trains the same model (fp32, AdamW) on the same batches in the
same processes; configurations interleave, --repeats times, and a step time
is the median over the steps after --warmup, each measured from a barrier,
the lowest median over repeats.

Checkpoint memory is what autograd keeps for backward through the blocks,
measured with saved-tensor hooks on one forward: all the blocks' saved
activations without checkpointing; their inputs with torch's checkpoint
(measured with its reentrant variant, which keeps them through
save_for_backward where hooks see them; the non-reentrant one keeps the same
tensors in a closure); each rank's slices of them with Pa. Everything is
printed as a ratio to torch's checkpointing.

Targets (issue 12): Pa's checkpoint memory at 1/MP of torch's (plus
padding), and its step time within 10% of torch's checkpointing. Each prints
PASS or MISS.
"""

from __future__ import annotations

import os
import statistics
import time

import _harness as harness

CONFIGS = ("none", "torch", "pa", "pa+cpu")


def parse_args(argv=None):
    p = harness.parser(__doc__, worker=False)
    p.add_argument("--ranks", type=int, default=2, help="ranks, all one tensor-parallel group (MP)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=2, help="interleaved runs of every configuration")
    for flag, default in (("--layers", 4), ("--d-model", 256), ("--heads", 8), ("--seq-len", 128)):
        p.add_argument(flag, type=int, default=default, help="the model's shape")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (every rank computes them all)")
    p.add_argument("--threads", type=int, default=None, help="threads per rank (default cores / ranks)")
    return p.parse_args(argv)


def _model(args, config):
    import torch
    import torch.distributed as dist

    from zerocore.examples.gpt import GPTConfig
    from zerocore.examples.tp_gpt import TPGPT

    torch.manual_seed(0)
    checkpointing = {"none": "none", "torch": "torch"}.get(config, "zerocore")
    cfg = GPTConfig(vocab=256, n_layer=args.layers, n_head=args.heads, d_model=args.d_model, seq_len=args.seq_len)
    return TPGPT(cfg, dist.group.WORLD, checkpointing=checkpointing,
                 offload="cpu" if config == "pa+cpu" else None)


def _checkpoint_bytes(model, config, x) -> int:
    """Bytes autograd keeps for the blocks' backward, seen by saved-tensor hooks."""
    import torch
    import torch.utils.checkpoint as torch_checkpoint
    from torch.autograd.graph import saved_tensors_hooks

    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    h = (model.tok_emb(x) + model.pos_emb(torch.arange(x.shape[1]))).detach().requires_grad_()
    with saved_tensors_hooks(pack, lambda t: t):
        for block in model.blocks:
            h = torch_checkpoint.checkpoint(block, h, use_reentrant=True) if config == "torch" \
                else model.run_block(block, h)
    h.sum().backward()
    return sum(sizes)


def _step_times(args, model, opt, batches) -> list:
    import torch.distributed as dist

    times = []
    for i, (x, y) in enumerate(batches):
        dist.barrier()
        t0 = time.perf_counter()
        model(x, y)["loss"].backward()
        opt.step()
        opt.zero_grad()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times


def run_rank(rank, args, port):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.ranks)
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    batches = [tuple(t.split(args.seq_len, dim=1))
               for t in [torch.randint(0, 256, (args.batch, 2 * args.seq_len), generator=g)
                         for _ in range(args.warmup + args.steps)]]
    results = {c: {"times": [], "bytes": None} for c in CONFIGS}
    for _ in range(args.repeats):
        for config in CONFIGS:
            model = _model(args, config)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            results[config]["times"].append(statistics.median(_step_times(args, model, opt, batches)))
            results[config]["bytes"] = _checkpoint_bytes(model, config, batches[0][0])
    if rank == 0:
        print(report(args, results, threads), flush=True)
    dist.destroy_process_group()


def report(args, results, threads) -> str:
    torch_ms, torch_bytes = min(results["torch"]["times"]), results["torch"]["bytes"]
    lines = [f"tensor-parallel GPT {args.layers} x {args.d_model} ({args.heads} heads), seq {args.seq_len}, batch "
             f"{args.batch}, fp32; MP = {args.ranks} CPU ranks (gloo) x {threads} thread(s); {args.steps} timed "
             f"steps after {args.warmup}, best median of {args.repeats}",
             f"  {'config':<8} {'step ms':>9} {'/ torch':>8} {'ckpt bytes/rank':>16} {'/ torch':>8}"]
    for config in CONFIGS:
        ms, nbytes = min(results[config]["times"]), results[config]["bytes"]
        lines.append(f"  {config:<8} {ms * 1e3:9.1f} {ms / torch_ms:8.3f} {nbytes:16,} {nbytes / torch_bytes:8.3f}")
    pa = results["pa"]
    memory_ok = pa["bytes"] * args.ranks - torch_bytes < args.ranks * 16 * args.layers
    time_ok = min(pa["times"]) <= 1.10 * torch_ms
    lines.append(f"  Pa checkpoint memory at 1/MP of torch's (+padding): {'PASS' if memory_ok else 'MISS'}; "
                 f"Pa step time within 10% of torch's: {'PASS' if time_ok else 'MISS'} "
                 f"({min(pa['times']) / torch_ms:.3f})")
    return "\n".join(lines)


def main(argv=None):
    import torch.multiprocessing as mp

    args = parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(run_rank, args=(args, harness.free_port()), nprocs=args.ranks, start_method="fork")


if __name__ == "__main__":
    main()
