"""How a policy fails: from `agentrl eval`'s eval_episodes.jsonl, the share of turns that changed nothing,
how many of those repeat the turn just before, and what the failed episodes' turns were spent on.

    .venv/bin/python scripts/eval_loops.py runs/ev-a/eval_episodes.jsonl runs/ev-b/eval_episodes.jsonl

One row per file; rows written before actions were recorded (no "actions" key) are skipped."""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def verb(action: str) -> str:
    """An action's command word(s) without its objects: 'go to cabinet 3' -> 'go to'."""
    words = action.split()
    if not words:
        return "(empty)"
    return " ".join(words[:2]) if words[0] == "go" else words[0]


def loop_stats(rows: list[dict]) -> dict:
    rows = [r for r in rows if "actions" in r]
    turns = sum(len(r["actions"]) for r in rows)
    ineffective = [(r, i) for r in rows for i in r["ineffective"]]
    repeats = sum(1 for r, i in ineffective if i > 0 and r["actions"][i] == r["actions"][i - 1])
    failed = [r for r in rows if not r["won"]]
    failed_turns = sum(len(r["actions"]) for r in failed)
    verbs = Counter(verb(a) for r in failed for a in r["actions"])
    # an action the episode already took at some earlier turn (revisits, loops of length > 1)
    seen_before = sum(1 for r in failed for i, a in enumerate(r["actions"]) if a in r["actions"][:i])
    return dict(episodes=len(rows), success=sum(r["won"] for r in rows) / max(1, len(rows)),
                ineffective=len(ineffective) / max(1, turns),
                ineffective_repeating_last=repeats / max(1, len(ineffective)),
                failed_turns_seen_before=seen_before / max(1, failed_turns),
                failed_distinct_actions=sum(len(set(r["actions"])) for r in failed) / max(1, len(failed)),
                failed_verbs={k: round(v / max(1, failed_turns), 3) for k, v in verbs.most_common(6)})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path, help="eval_episodes.jsonl files written by `agentrl eval`")
    args = p.parse_args(argv)
    for f in args.files:
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        print(json.dumps({"file": str(f), **loop_stats(rows)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
