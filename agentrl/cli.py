"""The `agentrl` command. Subcommands are added by the modules that own them."""
from __future__ import annotations

import argparse
import sys

from agentrl import __version__


def build_parser() -> argparse.ArgumentParser:
    from agentrl import bench_cmd, envs_cmd, serve_cmd

    parser = argparse.ArgumentParser(prog="agentrl", description="Multi-turn agent RL: train, evaluate and "
                                     "inspect LLM agents on text environments.")
    parser.add_argument("--version", action="version", version=f"agentrl {__version__}")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
    envs_cmd.add_parser(sub)
    serve_cmd.add_parser(sub)
    bench_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from envs.base import EnvError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except EnvError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
