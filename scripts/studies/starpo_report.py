"""Table of scripts/studies/starpo_study.sh runs: held-out success (first and last evaluation) and RAGEN's collapse
indicators, as the mean of the first and of the last 5 training steps."""
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
keys = [("success", "rollout success"), ("all_zero_groups", "all-zero groups"),
        ("group_entropy_bits", "group reward entropy, bits"), ("in_group_reward_std", "in-group reward std"),
        ("entropy", "token entropy"), ("grad_norm", "grad norm"), ("kl_episode", "KL to reference / episode")]
print("| recipe | seed | held-out success: start -> end | " + " | ".join(k[1] for k in keys) + " |")
print("| --- | --- | --- | " + " | ".join("---" for _ in keys) + " |")
for recipe in ("starpo", "starpo_s"):
    for s in (0, 1, 2):
        path = out / f"{recipe}-s{s}" / "metrics.jsonl"
        if not path.exists():
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        ev = [r["eval/success"] for r in rows if "eval/success" in r]
        steps = [r for r in rows if "success" in r]
        cells = []
        for key, _ in keys:
            v = [r[key] for r in steps if key in r]
            if not v:
                cells.append("-")
                continue
            first, last = v[:5], v[-5:]
            cells.append(f"{sum(first) / len(first):.2f} -> {sum(last) / len(last):.2f}")
        print(f"| {recipe} | {s} | {ev[0]:.3f} -> {ev[-1]:.3f} | " + " | ".join(cells) + " |")
