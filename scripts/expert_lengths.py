"""The env experts' episode lengths (turns to solve), as data for the horizon checks.

    python scripts/expert_lengths.py --tasks 100 sokoban frozenlake bandit > lengths.json

(tests/expert_lengths.json merges such outputs; each env's entry names the command that measured it.)

Per env: the expert plays ``--tasks`` train tasks (a seeded sample) to the end; the JSON gives the number
of tasks, how many it solved, and the median, 90th percentile and longest episode of the solved ones.
A recipe's ``rollout.max_turns`` on that env should cover the 90th percentile (tests/test_paper_suites.py).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys


def lengths(name: str, tasks: int, seed: int) -> dict[str, object]:
    from agentrl.envs import make
    from agentrl.envs.replay import run_expert

    env = make(name)
    try:
        ids = env.tasks("train")
        sample = random.Random(seed).sample(ids, min(tasks, len(ids)))
        solved: list[int] = []
        for task_id in sample:
            trace, _, info = run_expert(env, getattr(task_id, "task_id", task_id), max_steps=1000)
            if info.get("won"):
                solved.append(len(trace.actions))
    finally:
        env.close()
    solved.sort()
    p90 = solved[min(len(solved) - 1, int(round(0.9 * (len(solved) - 1))))] if solved else None
    return dict(tasks=len(sample), solved=len(solved), median=statistics.median(solved) if solved else None,
                p90=p90, max=solved[-1] if solved else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("envs", nargs="+")
    ap.add_argument("--tasks", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = {}
    for name in args.envs:
        out[name] = dict(lengths(name, args.tasks, args.seed),
                         command=f"python scripts/expert_lengths.py --tasks {args.tasks} --seed {args.seed} {name}")
        print(f"{name}: {out[name]}", file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
