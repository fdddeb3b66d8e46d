"""The zerocore command (also `python -m zerocore`):

    zerocore export CHECKPOINT OUT.safetensors
    zerocore estimate MODEL [--ranks N ...] [--dtype bf16] [--optimizer adamw] [--memory 80GB]
    zerocore estimate --memory 80GB --ranks 64
"""
import argparse
import sys

from zerocore.io.checkpoint_format import CheckpointError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerocore", description="zerocore's command-line tools (also run as "
                                     "python -m zerocore)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{export,estimate}")
    ex = commands.add_parser("export", help="write a checkpoint's full fp32 model as one safetensors file, "
                                            "loadable by model.load_state_dict",
                             description="Write a checkpoint's full fp32 model (engine.save's folder) as one "
                                         "safetensors file, loadable by model.load_state_dict.")
    ex.add_argument("checkpoint", help="the folder engine.save wrote")
    ex.add_argument("out", help="the .safetensors file to write")
    from zerocore.sizing import cli

    est = commands.add_parser(
        "estimate", help="will it fit? model-state bytes per rank, every stage, with and without offload; or the "
                         "largest model that fits in a memory",
        description="Will it fit? The model-state bytes (params, grads, optimizer states) each rank holds, per "
                    "ZeRO stage, with and without offload, on the device and on the host: by the ZeRO formulas "
                    "for a param count or a Hugging Face config.json, or exactly as zerocore.wrap lays out a "
                    "model that module:function builds. With --memory and no model: the largest model that fits.",
        epilog="examples:\n  zerocore estimate 7.5B --ranks 64 --dtype fp16 --optimizer adam --offload none\n"
               "  zerocore estimate path/to/config.json --ranks 8 --memory 80GB\n"
               "  zerocore estimate zerocore.examples.train:default_model --ranks 2\n"
               "  zerocore estimate --memory 80GB --ranks 64",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_arguments(est)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "export":
        from zerocore.io.export import export

        try:
            export(args.checkpoint, args.out)
        except CheckpointError as e:
            print(f"zerocore export: {e}", file=sys.stderr)
            return 1
        return 0
    from zerocore.sizing import cli
    from zerocore.sizing.quantities import EstimateError

    try:
        print(cli.run(args))
    except EstimateError as e:
        print(f"zerocore estimate: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
