"""Learning curves and diagnostics from runs' metrics.jsonl (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path

from agentrl.metrics import read_metrics

PANELS = [("eval/success", "held-out success"), ("success", "rollout success"),
          ("in_group_reward_std", "in-group reward std"), ("all_zero_groups", "all-zero group fraction"),
          ("group_entropy_bits", "group reward entropy (bits)"), ("entropy", "token entropy"),
          ("grad_norm", "gradient norm"), ("response_tokens", "response tokens / turn")]


def plot_runs(run_dirs: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    for run in run_dirs:
        rows = read_metrics(run)
        for ax, (key, title) in zip(axes.flat, PANELS):
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="o" if key.startswith("eval/") else None, label=run.name)
            ax.set_title(title)
            ax.set_xlabel("step")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
