"""`baton` entry point: one sub-command per module, each with `register(subparsers)` and `run(args)`."""

from __future__ import annotations

import argparse
import sys

from baton.cli import client_cmd, demo_cmd, generate_cmd, make_model_cmd, ray_cmd, secret_cmd, up_cmd

COMMANDS = (make_model_cmd, generate_cmd, up_cmd, ray_cmd, client_cmd, demo_cmd, secret_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Baton: disaggregated serving for hybrid models")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except ValueError as e:
        # User errors (bad flags, bad config, bad checkpoint) end with a clear message, not a traceback.
        print(f"baton {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
