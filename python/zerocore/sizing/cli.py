"""The `zerocore estimate` command: its arguments and what it prints."""
import os
import sys

from zerocore.sizing.estimate import OFFLOADS, OPTIMIZERS, estimate, largest_table
from zerocore.sizing.models import HF_ARCHITECTURES
from zerocore.sizing.quantities import UNITS, EstimateError


def add_arguments(p) -> None:
    """`zerocore estimate`'s arguments, on an argparse parser."""
    p.add_argument("model", nargs="?",
                   help="a param count (7.5B, 125M, 7500000000), module:function building the model (called "
                        "with no arguments on the meta device: nothing is allocated), or a Hugging Face "
                        f"config.json or its folder (model_type {', '.join(HF_ARCHITECTURES)}); leave it out "
                        "with --memory for the largest model that fits")
    p.add_argument("--ranks", type=int, nargs="+", default=[1], metavar="N",
                   help="data-parallel world size(s) (default: 1)")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"),
                   help="training dtype (16 bits: an fp32 master copy in the optimizer) (default: bf16)")
    p.add_argument("--reduce-dtype", default=None, choices=("fp32", "bf16", "fp16"),
                   help="dtype of the gradient buffers (default: --dtype)")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="(default: adamw)")
    p.add_argument("--no-momentum", action="store_true", help="sgd without momentum (no optimizer state)")
    p.add_argument("--stage", type=int, nargs="+", default=[0, 1, 2, 3], choices=(0, 1, 2, 3),
                   help="ZeRO stage(s) (default: 0 1 2 3)")
    p.add_argument("--offload", nargs="+", default=list(OFFLOADS), choices=list(OFFLOADS),
                   help="none; optimizer (offload_optimizer='cpu', stages 1-3); params (and offload_params='cpu', "
                        "stage 3) (default: all three)")
    p.add_argument("--delayed-update", action="store_true",
                   help="offloaded: the delayed update's second host grad buffer (stages 2-3)")
    p.add_argument("--memory", default=None,
                   help="memory per device, with a unit (80GB, 80GiB): with a model, whether it fits; without, "
                        "the largest model that fits")
    p.add_argument("--host-memory", default=None, help="host memory per rank, with a unit, for the same questions")
    p.add_argument("--unit", default=None, choices=list(UNITS),
                   help="unit of the table (default: the largest of B, KB, MB, GB, TB that shows the largest "
                        "figure as 1 or more)")
    p.add_argument("--bucket-bytes", type=int, default=None,
                   help="module:function: Config.bucket_bytes of the layout (default: the engine's)")
    p.add_argument("--persist-threshold", type=int, default=None,
                   help="module:function: Config.persist_threshold of the layout (default: the engine's)")


def run(args) -> str:
    """What `zerocore estimate` prints for parsed arguments."""
    if args.model is None:
        if args.memory is None:
            raise EstimateError("give a model (a param count, module:function or config.json), or --memory for "
                                "the largest model that fits")
        if args.reduce_dtype is not None or args.delayed_update:
            raise EstimateError("--reduce-dtype and --delayed-update apply to a model's estimate only")
        return largest_table(args.memory, args.ranks, args.dtype, args.optimizer, momentum=not args.no_momentum,
                             stages=args.stage, offload=args.offload, host_memory=args.host_memory)
    config = {"reduce_dtype": args.reduce_dtype, "bucket_bytes": args.bucket_bytes,
              "persist_threshold": args.persist_threshold, "delayed_update": args.delayed_update}
    config = {k: v for k, v in config.items() if v not in (None, False)}
    sys.path.insert(0, os.getcwd())  # module:function may name a module of the current folder, as python -m does
    try:
        est = estimate(args.model, args.ranks, args.dtype, args.optimizer, momentum=not args.no_momentum,
                       stages=args.stage, offload=args.offload, config=config or None)
    finally:
        sys.path.remove(os.getcwd())
    return est.table(args.unit, args.memory, args.host_memory)
