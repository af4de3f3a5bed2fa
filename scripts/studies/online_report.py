"""Table of scripts/studies/paper_study.sh runs: held-out success (first and last eval), group diagnostics over all
training groups and split into fresh / replay groups where the recipe logs them, env steps used."""
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
print("| recipe | seed | held-out success, step 0 -> final (greedy) | all-zero groups, all / fresh / replay | "
      "all-one groups, all / fresh / replay | group entropy (bits), all | RL steps | env steps |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
summary = {}
for recipe in sys.argv[2:]:
    for s in (0, 1, 2):
        path = out / f"{recipe}-s{s}" / "metrics.jsonl"
        if not path.exists():
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        ev = [r for r in rows if "eval/success" in r]
        steps = [r for r in rows if "all_zero_groups" in r]

        def mean(key, steps=steps):
            v = [r[key] for r in steps if key in r]
            return sum(v) / len(v) if v else float("nan")

        env_steps = sum(r.get("env_steps", 0) for r in rows)
        fresh, replay = mean("fresh/all_zero_groups"), mean("replay/all_zero_groups")
        z = f"{mean('all_zero_groups'):.2f}" + (f" / {fresh:.2f} / {replay:.2f}" if fresh == fresh else "")
        r1 = mean("replay/all_one_groups")
        ones = f" / {mean('fresh/all_one_groups'):.2f} / {r1:.2f}" if r1 == r1 else ""
        print(f"| {recipe} | {s} | {ev[0]['eval/success']:.3f} -> {ev[-1]['eval/success']:.3f} | {z} | "
              f"{mean('all_one_groups'):.2f}{ones} | {mean('group_entropy_bits'):.2f} | {len(steps)} | "
              f"{env_steps:.0f} |")
        summary.setdefault(recipe, []).append(ev[-1]["eval/success"] - ev[0]["eval/success"])
print()
for recipe, d in summary.items():
    print(f"{recipe}: change in held-out success {sum(d) / len(d):+.3f} (range {min(d):+.3f} to {max(d):+.3f}) "
          f"over {len(d)} seeds")
