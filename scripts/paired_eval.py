"""Paired evaluation of finished runs: each run's warm start and last checkpoint on the same held-out tasks.

    .venv/bin/python scripts/paired_eval.py runs/grpo-sokoban-s0 runs/grpo-sokoban-s1 --splits valid test \\
        --tasks 500

One ``agentrl eval`` per (run, model, split), greedy unless overridden, with the run's own recipe and env,
so the numbers are the run's own evaluation on more tasks. Prints one JSON line per run: success before
and after on every split, the paired change and its standard error (from per-task differences).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml


def _episodes(run: Path, model: Path, split: str, tasks: int, overrides: list[str]) -> dict[str, float]:
    """Per-task success of ``model`` on ``split``, read from the eval run's episode log."""
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "agentrl.cli", "eval", "--env", cfg["env"], "--model", str(model),
               "--split", split, "--tasks", str(tasks), "--seed", str(cfg["trainer"]["seed"]), "--out", out,
               f"rollout.max_turns={cfg['rollout']['max_turns']}",
               f"rollout.max_new_tokens={cfg['rollout']['max_new_tokens']}",
               f"rollout.prompt={cfg['rollout'].get('prompt', 'default')}", *overrides]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in (Path(out) / "eval_episodes.jsonl").read_text().splitlines()]
    return {r["task_id"]: float(r["won"]) for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--splits", nargs="+", default=["valid"])
    ap.add_argument("--tasks", type=int, default=500)
    ap.add_argument("-o", "--overrides", nargs="*", default=[])
    a = ap.parse_args()
    for run in map(Path, a.runs):
        last = sorted((run / "checkpoints").glob("step-*"))[-1] / "model"
        row: dict = {"run": str(run), "after": last.parent.name}
        for split in a.splits:
            before = _episodes(run, run / "warm_start", split, a.tasks, a.overrides)
            after = _episodes(run, last, split, a.tasks, a.overrides)
            diffs = [after[t] - before[t] for t in before]
            n = len(diffs)
            mean = sum(diffs) / n
            sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / max(1, n - 1))
            row[split] = {"n": n, "before": round(sum(before.values()) / n, 4),
                          "after": round(sum(after.values()) / n, 4), "change": round(mean, 4),
                          "change_se": round(sd / math.sqrt(n), 4)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
