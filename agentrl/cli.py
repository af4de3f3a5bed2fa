"""The `agentrl` command. Subcommands are added by the modules that own them."""
from __future__ import annotations

import argparse
import sys

from agentrl import __version__


def build_parser() -> argparse.ArgumentParser:
    from agentrl import bench_cmd, envs_cmd, serve_cmd, train_cmd

    parser = argparse.ArgumentParser(prog="agentrl", description="Multi-turn agent RL: train, evaluate and "
                                     "inspect LLM agents on text environments.")
    parser.add_argument("--version", action="version", version=f"agentrl {__version__}")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
    train_cmd.add_parser(sub)
    envs_cmd.add_parser(sub)
    serve_cmd.add_parser(sub)
    bench_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from agentrl.config import ConfigError
    from agentrl.registry import RegistryError
    from envs.base import EnvError

    parser = build_parser()
    # Dotted overrides (key.sub=value) may come after options; argparse leaves them over: collect them.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or not all("=" in x and not x.startswith("-") for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides or []) + extra
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except (EnvError, ConfigError, RegistryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
