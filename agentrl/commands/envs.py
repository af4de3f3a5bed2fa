"""`agentrl envs`: list the registered envs, play one by hand, or run an env's self-check."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from agentrl.envs import registry
from agentrl.envs.base import SPLITS, EnvError
from agentrl.envs.replay import Trace, replay

PLAY_HELP = """commands while playing:
  <text>     send the text as an action
  :expert    take the expert's action (also :e)
  :actions   list admissible actions (also :a)
  :undo      go back one step by replay-prefix restore (also :u)
  :restart   start the task again
  :quit      leave (also :q, Ctrl-D)"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("envs", help="list envs, play one by hand, check experts and restore",
                       description="List registered envs with task counts, play a task interactively, or "
                                   "self-check an env (expert success, replay-prefix restore, tampering).")
    s = p.add_subparsers(dest="envs_cmd")
    ls = s.add_parser("list", help="registered envs with task counts per split")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.add_argument("--only", nargs="*", help="only these env names")
    ls.add_argument("--suite", choices=["gem", "textarena", "rg"],
                    help="every env id an outside suite registers (GEM, TextArena, reasoning-gym), one per line")
    pl = s.add_parser("play", help="play one task by hand", epilog=PLAY_HELP,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    pl.add_argument("env", help="env name (see `agentrl envs list`)")
    pl.add_argument("--task", help="task id, e.g. train/00003 (default: first task of --split)")
    pl.add_argument("--split", default="train", choices=SPLITS)
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--max-steps", type=int, default=None)
    ck = s.add_parser("check", help="expert success and restore checks on sampled tasks")
    ck.add_argument("env", nargs="*", help="env name(s)")
    ck.add_argument("--fast", action="store_true", help="also every env registered as fast (the pure-Python ones)")
    ck.add_argument("--tasks", type=int, default=50, help="tasks the expert plays (default 50)")
    ck.add_argument("--replay-tasks", type=int, default=20, help="tasks whose restore is checked (default 20)")
    ck.add_argument("--split", default="train", choices=SPLITS)
    ck.add_argument("--seed", type=int, default=0)
    ck.add_argument("--max-steps", type=int, default=None, help="override the env's episode step limit")
    ck.add_argument("--json", help="also write the reports to this JSON file")
    ck.add_argument("-v", "--verbose", action="store_true")
    demo = s.add_parser("demo", help="print expert episodes, one per task category")
    demo.add_argument("env")
    demo.add_argument("--split", default="train", choices=SPLITS)
    demo.add_argument("--per-category", type=int, default=1)
    bench = s.add_parser("bench", help="time resets and steps (expert actions) on sampled tasks")
    bench.add_argument("env", nargs="+")
    bench.add_argument("--tasks", type=int, default=10)
    gen = s.add_parser("generate", help="build generated tasks ahead of time, in parallel (cached)")
    gen.add_argument("env", help="env name (textworld, alfworld)")
    gen.add_argument("--split", nargs="+", default=["train"], choices=SPLITS)
    gen.add_argument("--n", type=int, default=None, help="tasks per split (default: all)")
    gen.add_argument("--workers", type=int, default=2)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.envs_cmd in (None, "list"):
        if getattr(args, "suite", None):
            return cmd_list_suite(args.suite)
        return cmd_list(getattr(args, "only", None), getattr(args, "json", False))
    if args.envs_cmd == "play":
        return cmd_play(args)
    if args.envs_cmd == "generate":
        return cmd_generate(args)
    if args.envs_cmd == "demo":
        return cmd_demo(args)
    if args.envs_cmd == "bench":
        return cmd_bench(args)
    return cmd_check(args)


def cmd_list(only: list[str] | None, as_json: bool) -> int:
    rows = []
    for name in only or registry.names():
        spec = registry.spec(name)
        try:
            env = registry.make(name)
            counts = {s: len(env.tasks(s)) for s in SPLITS}
            cats = env.categories()
            restore = "snapshot, replay" if env.supports_snapshot else "replay"
            env.close()
            rows.append(dict(env=name, description=spec.description, restore=restore, categories=len(cats), **counts))
        except Exception as e:  # an engine that cannot start here is reported, not fatal for the listing
            rows.append(dict(env=name, description=spec.description, error=f"{type(e).__name__}: {e}"))
    if not only:
        rows += _outside_rows()
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="agentrl envs")
    for col in ("env", "train", "valid", "test", "categories", "restore", "description"):
        table.add_column(col, justify="right" if col in ("train", "valid", "test", "categories") else "left",
                         no_wrap=col != "description")
    for r in rows:
        if "error" in r:
            table.add_row(r["env"], "-", "-", "-", "-", "-", f"[red]{r['error']}[/red]")
        else:
            table.add_row(r["env"], str(r["train"]), str(r["valid"]), str(r["test"]), str(r["categories"] or "-"),
                          r["restore"], r["description"])
    Console(width=None if sys.stdout.isatty() else 130).print(table)
    return 0


SUITE_NAMES = {"gem": "GEM", "textarena": "TextArena", "rg": "reasoning-gym"}


def _outside_rows() -> list[dict[str, Any]]:
    """One row per way in for outside envs (replay-prefix restore, 1000 seeded tasks per split)."""
    from agentrl.envs.suites import SUITES, suite_ids

    rows = [dict(env="gymnasium:<id>", train=1000, valid=1000, test=1000, categories=0, restore="replay",
                 description="any Gymnasium env with text observations and actions")]
    for suite, (_, package) in SUITES.items():
        row = dict(env=f"{suite}:<id>", train=1000, valid=1000, test=1000, categories=0, restore="replay")
        try:
            ids = suite_ids(suite)
            example = next((i for i in ids if "GuessTheNumber" in i or i == "basic_arithmetic"), ids[0])
            row["description"] = (f"{SUITE_NAMES[suite]}: {len(ids)} ids, e.g. {suite}:{example} "
                                  f"(agentrl envs list --suite {suite})")
        except ImportError:
            row = dict(env=f"{suite}:<id>", description=SUITE_NAMES[suite],
                       error=f"not installed: pip install -e '.[suites]' ({package})")
        rows.append(row)
    return rows


def cmd_list_suite(suite: str) -> int:
    from agentrl.envs.suites import SUITES, suite_ids

    try:
        ids = suite_ids(suite)
    except ImportError:
        print(f"error: {SUITES[suite][1]} is not installed: pip install -e '.[suites]'", file=sys.stderr)
        return 1
    for i in ids:
        print(f"{suite}:{i}")
    return 0


def cmd_play(args: argparse.Namespace) -> int:
    kwargs = {"max_steps": args.max_steps} if args.max_steps else {}
    env = registry.make(args.env, **kwargs)
    task_id = args.task or env.tasks(args.split)[0].task_id
    trace = Trace(env.name, task_id, args.seed)
    obs, info = env.reset(task_id, args.seed)
    trace.fingerprints.append(info["fingerprint"])
    total = 0.0
    print(f"== {env.name} / {task_id} (seed {args.seed}) ==  type :help for commands")
    if env.instruction():
        print(f"Task: {env.instruction()}")
    print(obs)
    try:
        while True:
            if env.done:
                print(f"-- episode over: won={info.get('won')} score={info.get('score', 0):.3f} "
                      f"return={total:.2f}; :restart, :undo or :quit")
            try:
                line = input(f"[step {env.steps}]> ").strip()
            except EOFError:
                print()
                break
            if line in (":q", ":quit"):
                break
            if line in (":help", ":h", "?"):
                print(PLAY_HELP)
                continue
            if line in (":a", ":actions"):
                print("\n".join(info.get("admissible_actions") or ["(this env lists no admissible actions)"]))
                continue
            if line == ":restart":
                trace = Trace(env.name, task_id, args.seed)
                obs, info = env.reset(task_id, args.seed)
                trace.fingerprints.append(info["fingerprint"])
                total = 0.0
                print(obs)
                continue
            if line in (":u", ":undo"):
                if not trace.actions:
                    print("(nothing to undo)")
                    continue
                trace = trace.prefix(len(trace.actions) - 1)
                obs, info = replay(env, trace)
                print(f"(restored to step {env.steps} by replaying {len(trace.actions)} action(s))\n{obs}")
                continue
            if env.done:
                continue
            if line in (":e", ":expert"):
                line = env.expert_action() or ""
                if not line:
                    print("(the expert has no action from this state)")
                    continue
                print(f"expert: {line}")
            if not line:
                continue
            obs, reward, term, trunc, info = env.step(line)
            trace.actions.append(line)
            trace.fingerprints.append(info["fingerprint"])
            total += reward
            flag = "" if info.get("action_is_valid", True) else "  (not an admissible action)"
            print(f"{obs}\n   reward {reward:+.2f}{flag}{'  [terminated]' if term else ''}"
                  f"{'  [truncated]' if trunc else ''}")
    finally:
        env.close()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from agentrl.envs.replay import run_expert

    env = registry.make(args.env)
    shown: dict[str, int] = {}
    try:
        for task in env.tasks(args.split):
            if shown.get(task.category, 0) >= args.per_category:
                continue
            shown[task.category] = shown.get(task.category, 0) + 1
            trace, observations, info = run_expert(env, task.task_id)
            print(f"===== {task.task_id}  [{task.category or env.name}]")
            if env.instruction():
                print(f"Your task is to: {env.instruction()}")
            print(observations[0])
            for action, obs in zip(trace.actions, observations[1:]):
                print(f"> {action}\n{obs}")
            print(f"-- won={info.get('won')} score={info.get('score', 0):.2f} steps={len(trace.actions)}\n")
    finally:
        env.close()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Per env: first reset of a task (builds/loads it), a repeated reset, and expert steps, in ms."""
    import statistics
    import time

    def ms(xs: list[float]) -> str:
        return f"median {1000 * statistics.median(xs):.1f} ms, p90 {1000 * sorted(xs)[int(0.9 * (len(xs) - 1))]:.1f} ms"

    for name in args.env:
        env = registry.make(name)
        first, again, steps = [], [], []
        try:
            for task in env.tasks("train")[:args.tasks]:
                t = time.perf_counter()
                env.reset(task.task_id)
                first.append(time.perf_counter() - t)
                t = time.perf_counter()
                env.reset(task.task_id)
                again.append(time.perf_counter() - t)
                while not env.done:
                    action = env.expert_action()
                    if action is None:
                        break
                    t = time.perf_counter()
                    env.step(action)
                    steps.append(time.perf_counter() - t)
        finally:
            env.close()
        print(f"{name}: first reset {ms(first)}; repeated reset {ms(again)}; step {ms(steps)} "
              f"({len(steps)} steps over {len(first)} tasks)")
    return 0


_GEN_ENV: Any = None


def _prepare_one(job: tuple[str, str]) -> str:
    global _GEN_ENV
    name, task_id = job
    if _GEN_ENV is None or _GEN_ENV.name != name:
        _GEN_ENV = registry.make(name)
    _GEN_ENV.prepare(task_id)
    return task_id


def cmd_generate(args: argparse.Namespace) -> int:
    import multiprocessing as mp
    import time

    from agentrl.progress import Progress

    env = registry.make(args.env)
    jobs = [(args.env, t.task_id) for split in args.split for t in env.tasks(split)[:args.n]]
    env.close()
    t0 = time.time()
    with Progress(f"generating {args.env}", len(jobs)) as progress, mp.get_context("spawn").Pool(args.workers) as pool:
        for _ in pool.imap_unordered(_prepare_one, jobs):
            progress.advance()
    print(f"{len(jobs)} {args.env} tasks ready in {time.time() - t0:.1f}s with {args.workers} workers")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from agentrl.envs.check import check_env

    from agentrl.envs.registry import fast_names

    todo = list(dict.fromkeys((fast_names() if args.fast else []) + args.env))
    if not todo:
        raise EnvError("name the envs to check, or --fast for the fast ones")
    reports, ok = [], True
    for name in todo:
        rep = check_env(name, n_expert=args.tasks, n_replay=args.replay_tasks, split=args.split, seed=args.seed,
                        env_kwargs={"max_steps": args.max_steps} if args.max_steps else None, verbose=args.verbose)
        print(rep.summary(), flush=True)
        ok &= rep.ok
        reports.append(dict(rep.__dict__, success_rate=rep.success_rate))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentrl.envs")
    sub = parser.add_subparsers(dest="cmd")
    add_parser(sub)
    args = parser.parse_args(["envs", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except EnvError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
