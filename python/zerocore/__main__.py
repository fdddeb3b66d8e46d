"""python -m zerocore export CHECKPOINT OUT.safetensors"""
import argparse
import sys

from zerocore.checkpoint_format import CheckpointError
from zerocore.export import export


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerocore")
    commands = parser.add_subparsers(dest="command", required=True)
    ex = commands.add_parser("export", help="write a checkpoint's full fp32 model as one safetensors file, "
                                            "loadable by model.load_state_dict")
    ex.add_argument("checkpoint", help="the folder engine.save wrote")
    ex.add_argument("out", help="the .safetensors file to write")
    args = parser.parse_args(argv)
    try:
        export(args.checkpoint, args.out)
    except CheckpointError as e:
        print(f"zerocore export: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
