"""Tables and the pass@k plot of scripts/studies/offline_study.sh (reads the runs' final.json / eval JSON)."""
import json
import sys
from pathlib import Path

out, png = Path(sys.argv[1]), Path(sys.argv[2])


def final(run: str) -> dict:
    p = out / run / "final.json"
    if p.exists():
        return json.loads(p.read_text())
    text = (out / f"{run}.json").read_text()
    return json.loads(text[text.index("{"):])


def first_step(run: str) -> dict:
    rows = [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["step"] == 1)


curves = {}
for label, run in [("SFT warm start", "passk-sft"), ("GRPO (15 steps)", "passk-grpo-s0"),
                   ("LEAFE, lr 1e-3", "leafe-s0"), ("LEAFE, lr 5e-5", "leafe_lr5e-5-s0"),
                   ("early_exp, lr 1e-3", "early_exp-s0"), ("early_exp, lr 5e-5", "early_exp_lr5e-5-s0")]:
    try:
        f = final(run)
    except (FileNotFoundError, ValueError, StopIteration):
        continue
    curves[label] = sorted((int(k.split("@")[1]), v) for k, v in f.items() if k.startswith("eval/pass@"))
ks = sorted({k for c in curves.values() for k, _ in c})
print("| policy | " + " | ".join(f"pass@{k}" for k in ks) + " |")
print("| --- |" + " --- |" * len(ks))
for label, c in curves.items():
    d = dict(c)
    print(f"| {label} | " + " | ".join(f"{d[k]:.3f}" if k in d else "-" for k in ks) + " |")
print()
print("| method | candidates sampled per step | step-level pairs | outcome pairs (IPR) | SFT rows (IPR) | "
      "held-out success (greedy, 96), before -> after |")
print("| --- | --- | --- | --- | --- | --- |")
for r in ("rro", "ipr"):
    try:
        rows = [json.loads(line) for line in (out / f"{r}-s0" / "metrics.jsonl").read_text().splitlines()]
    except FileNotFoundError:
        continue
    ev = [x for x in rows if "eval/success" in x]
    s1 = next(x for x in rows if x["step"] == 1)
    print(f"| {r} | {s1['candidates_per_step']:.2f} | {s1.get('dpo_pairs', 0):.0f} | "
          f"{s1.get('outcome_dpo_pairs', 0):.0f} | {s1.get('sft_samples', 0):.0f} | "
          f"{ev[0]['eval/success']:.3f} -> {ev[-1]['eval/success']:.3f} |")
for run in ("leafe_lr5e-5-s0",):
    try:
        s = first_step(run)
        print("\nLEAFE stage 1:", {k: v for k, v in s.items() if k.startswith("leafe_")})
    except FileNotFoundError:
        pass

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(6, 4))
for label, c in curves.items():
    ax.plot([k for k, _ in c], [v for _, v in c], marker="o", label=label)
ax.set_xscale("log", base=2)
ax.set_xlabel("k (samples per held-out level, T=1)")
ax.set_ylabel("pass@k")
ax.legend(fontsize=8)
fig.tight_layout()
png.parent.mkdir(parents=True, exist_ok=True)
fig.savefig(png, dpi=90)
print(f"\nwrote {png}")
