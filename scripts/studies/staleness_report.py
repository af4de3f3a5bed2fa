"""Table of scripts/studies/staleness_study.sh runs: held-out success at each evaluation, the gain over the
warm start, the staleness and correction metrics and the wall time per step, per seed and as mean (range)."""
import json
import statistics
import sys
from pathlib import Path

from agentrl.metrics import read_metrics

out = Path(sys.argv[1])
arms = (("sync", "max_staleness 0 (make train)"), ("stale1", "max_staleness 1"))
summary: dict[str, dict[str, list[float]]] = {}
print("| run | seed | held-out success by step | gain, points | staleness mean | behav. weight mean | "
      "truncated frac | s / step |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for arm, label in arms:
    for run in sorted(out.glob(f"{arm}-s*")):
        rows = read_metrics(run)
        if not run.is_dir() or not (run / "final.json").exists():
            continue
        ev = [(r["step"], r["eval/success"]) for r in rows if "eval/success" in r]
        steps = [r for r in rows if "success" in r and r.get("step", 0) > 0]

        def mean(key: str, steps: list[dict] = steps) -> float:
            v = [r[key] for r in steps if key in r]
            return sum(v) / len(v) if v else float("nan")

        gain = 100 * (ev[-1][1] - ev[0][1])
        s = summary.setdefault(arm, {"start": [], "end": [], "gain": []})
        s["start"].append(ev[0][1])
        s["end"].append(ev[-1][1])
        s["gain"].append(gain)
        by_step = " / ".join(f"{v:.3f}" for _, v in ev)
        print(f"| {label} | {run.name.rsplit('-s', 1)[1]} | {by_step} | {gain:+.1f} | {mean('staleness_mean'):.2f} | "
              f"{mean('behav_is_mean'):.3f} | {mean('behav_is_truncated_frac'):.4f} | {mean('time_step_s'):.1f} |")
print()
for arm, label in arms:
    if arm in summary:
        g, start, end = summary[arm]["gain"], summary[arm]["start"], summary[arm]["end"]
        print(f"{label}: start {statistics.mean(start):.3f}, end {statistics.mean(end):.3f}, "
              f"gain {statistics.mean(g):+.1f} ({min(g):+.1f} to {max(g):+.1f}) over {len(g)} seeds")
print(json.dumps(summary))
