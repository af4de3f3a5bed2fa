"""The `agentrl` command. Subcommands are added by the modules that own them."""
from __future__ import annotations

import argparse
import os
import sys

from agentrl import __version__


def build_parser() -> argparse.ArgumentParser:
    from agentrl.commands import bench, envs, reproduce, serve, train, view

    parser = argparse.ArgumentParser(prog="agentrl", description="Multi-turn agent RL: train, evaluate and "
                                     "inspect LLM agents on text environments.")
    parser.add_argument("--version", action="version", version=f"agentrl {__version__}")
    parser.add_argument("--import", dest="plugins", metavar="MODULE", action="append", default=[],
                        help="import a module of yours first, so the envs, recipes, estimators, losses and filters "
                             "it registers are known by name (repeatable; anywhere on the line; also "
                             "$AGENTRL_PLUGINS=mod1,mod2)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=None,
                        help="diagnostics on stderr (default: $AGENTRL_LOG_LEVEL, else info)")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
    train.add_parser(sub)
    envs.add_parser(sub)
    serve.add_parser(sub)
    bench.add_parser(sub)
    view.add_parser(sub)
    reproduce.add_parser(sub)
    return parser


def strip_launcher_args(argv: list[str]) -> list[str]:
    """Drop the ``--local_rank=N`` (or ``--local-rank N``) the deepspeed and older torch launchers put
    before our own arguments; the rank is read from the environment (LOCAL_RANK) they also set."""
    out: list[str] = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        for flag in ("--local_rank", "--local-rank"):
            if a == flag:
                if i + 1 < len(argv):
                    os.environ.setdefault("LOCAL_RANK", argv[i + 1])
                skip = True
                break
            if a.startswith(flag + "="):
                os.environ.setdefault("LOCAL_RANK", a.split("=", 1)[1])
                break
        else:
            out.append(a)
    return out


def take_imports(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without them, the modules) for every ``--import MODULE`` / ``--import=MODULE``, wherever it
    stands: ``agentrl envs check guess --import mypkg.envs`` reads as naturally as before the command."""
    out: list[str] = []
    mods: list[str] = []
    it = iter(argv)
    for a in it:
        if a == "--import":
            mods.append(next(it, ""))
        elif a.startswith("--import="):
            mods.append(a.split("=", 1)[1])
        else:
            out.append(a)
    return out, mods


def main(argv: list[str] | None = None) -> int:
    from agentrl import dist
    from agentrl.dist import RankFailed
    from agentrl.config import ConfigError
    from agentrl.generation.client import GenerationServerError
    from agentrl.learner.engine import LearnerOutOfMemory
    from agentrl.learner.models import ModelError
    from agentrl.registry import RegistryError
    from agentrl.trainer import RunError
    from agentrl.envs.base import EnvError

    argv, plugins = take_imports(strip_launcher_args(list(sys.argv[1:] if argv is None else argv)))
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
        from agentrl.learner.models import cap_kernel_caches
        from agentrl.logs import setup_logging

        setup_logging(args.log_level)
        from agentrl.registry import add_plugin

        for module in plugins:
            if not module:
                raise RegistryError("--import needs a module name, e.g. --import mypkg.envs")
            add_plugin(module)
        cap_kernel_caches()  # before the first matmul of any command (agentrl/learner/models.py says why)
        try:
            return int(args.func(args) or 0)
        except BaseException as e:  # launched on several ranks: every rank ends with it, none waits for this one
            from agentrl.fail_fast import fail_every_rank

            fail_every_rank(e, None)
            raise
    except (EnvError, ConfigError, RegistryError, GenerationServerError, ModelError, RunError,
            LearnerOutOfMemory, RankFailed) as e:
        where = f"[rank {dist.rank()}] " if dist.launched_world() > 1 else ""
        print(f"{where}error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
