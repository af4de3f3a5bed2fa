"""`agentrl view RUN [RUN ...]` (the rollout records and curves in a browser) and `agentrl show RUN --step N`
(the same records in the terminal)."""
from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    v = sub.add_parser("view", help="browse run folders' curves and recorded rollouts in a local web app",
                       description="Serve a page with the runs' curves (overlaid), their recorded steps, groups and "
                                   "episodes (RUN/rollouts), on loopback unless --host says otherwise.")
    v.add_argument("runs", nargs="+", metavar="RUN", help="run folders (trainer.out_dir)")
    v.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only; any other needs a key)")
    v.add_argument("--port", type=int, default=8200, help="port (default 8200; 0: a free one)")
    v.add_argument("--api-key", default=os.environ.get("AGENTRL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (a browser: open the page once with ?key=KEY) on every "
                        "route but /health (default: $AGENTRL_API_KEY; none: no key, loopback only)")
    v.set_defaults(func=run_view)
    s = sub.add_parser("show", help="print a run's recorded episodes of a step in the terminal",
                       description="The rollout records of one step (RUN/rollouts): its groups, or one group's "
                                   "episodes turn by turn.")
    s.add_argument("run", metavar="RUN", help="a run folder")
    s.add_argument("--step", type=int, help="the step (default: the last recorded)")
    s.add_argument("--group", help="a group's id or its index in the step (default: the step's groups listed)")
    s.add_argument("--split", choices=["train", "eval"], default="train", help="training or evaluation records")
    s.set_defaults(func=run_show)


def _loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


def open_runs(paths: list[str]) -> list[Any]:
    from agentrl.config import ConfigError
    from agentrl.runs import open_run

    out = []
    for p in paths:
        if not Path(p).is_dir():
            raise ConfigError(f"{p} is not a run folder (no such directory)")
        out.append(open_run(p))
    return out


def run_view(args: argparse.Namespace) -> int:
    from agentrl.config import ConfigError

    if not _loopback(args.host) and not args.api_key:
        raise ConfigError(f"--host {args.host} is reachable from other machines: give --api-key KEY (or "
                          "$AGENTRL_API_KEY), or keep the default loopback --host 127.0.0.1")
    runs = open_runs(args.runs)
    from agentrl.viewer.serve import start_viewer  # the server stack only once the arguments hold
    try:
        server = start_viewer(runs, args.host, args.port, args.api_key)
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        print(f"error: cannot listen on {args.host}:{args.port} ({why}): pick another --port or --host",
              file=sys.stderr)
        return 2
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"viewing {', '.join(r.name for r in runs)} on http://{host}:{server.server_address[1]}/  (Ctrl-C stops)",
          flush=True)
    try:
        import threading

        threading.Event().wait()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.shutdown()
    return 0


def run_show(args: argparse.Namespace) -> int:
    from agentrl.config import ConfigError
    from agentrl.viewer.terminal import show

    run = open_runs([args.run])[0]
    steps = run.steps(args.split)
    if not steps:
        raise ConfigError(f"{args.run} has no {args.split} records (RUN/rollouts/{args.split}.jsonl.gz; "
                          "trainer.record_groups=-1 turns them off)")
    try:
        show(run, args.step if args.step is not None else steps[-1], args.group, args.split)
    except KeyError as e:
        raise ConfigError(str(e.args[0])) from None
    return 0
