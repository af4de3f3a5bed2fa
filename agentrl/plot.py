"""Learning curves and diagnostics from runs' metrics.jsonl (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from agentrl.metrics import read_metrics

PANELS = [("eval/success", "held-out success"), ("success", "rollout success"),
          ("in_group_reward_std", "in-group reward std"), ("all_zero_groups", "all-zero group fraction"),
          ("group_entropy_bits", "group reward entropy (bits)"), ("entropy", "token entropy"),
          ("grad_norm", "gradient norm"), ("response_tokens", "response tokens / turn"),
          ("reward_mean", "rollout reward (mean)")]

# CRPS's mechanism (recipes/crps.py logs these): a third row when a run has a success buffer
CRPS_PANELS = [("buffer_size", "success buffer entries"), ("replay_groups", "replay groups / step"),
               ("k_mean", "suffix k of the step's replays (mean)"), ("replay/success", "replay-group success")]


def plot_runs(run_dirs: list[Path], out: Path) -> None:
    import matplotlib.pyplot as plt

    names = [run.name for run in run_dirs]
    labels = [name if names.count(name) == 1 else str(run) for name, run in zip(names, run_dirs)]
    fig = runs_figure({label: read_metrics(run) for label, run in zip(labels, run_dirs)})
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def runs_figure(runs: dict[str, list[dict]]) -> Any:
    """One panel per metric some run logged, every run in its own colour in every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    crps = any("buffer_size" in r for rows in runs.values() for r in rows)
    # the score is the success rate except where an env gives partial credit (WebShop, TextWorld)
    partial = any(r.get("eval/score", r.get("eval/success")) != r.get("eval/success")
                  for rows in runs.values() for r in rows)
    score = [("eval/score", "held-out score")] if partial else []
    panels = PANELS[:1] + score + PANELS[1:] + (CRPS_PANELS if crps else [])
    n_rows = -(-len(panels) // 4)
    fig, axes = plt.subplots(n_rows, 4, figsize=(16, 3.5 * n_rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, rows) in enumerate(runs.items()):
        for ax, (key, title) in zip(axes.flat, panels):
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:  # one colour per run in every panel, also where another run logged nothing
                sparse = key.startswith("eval/") or len(pts) < 3 or any(b - a > 1 for (a, _), (b, _) in
                                                                         zip(pts, pts[1:]))
                ax.plot(*zip(*pts), marker="o" if sparse else None, label=name, color=palette[i % len(palette)])
            ax.set_title(title)
            ax.set_xlabel("step")
            if key == "replay/success":  # the band CRPS's k controller steers replay success into
                ax.axhspan(0.2, 0.8, color="green", alpha=0.08)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


COMPARE_PANELS = [("eval/success", "held-out success"), ("success", "rollout success (all groups)"),
                  ("all_zero_groups", "all-zero group fraction (all groups)"),
                  ("all_one_groups", "all-one group fraction (all groups)"),
                  ("replay/all_zero_groups", "all-zero fraction, replay groups (CRPS, exp_replay)"),
                  ("group_entropy_bits", "group reward entropy, bits (all groups)")]


def run_label(run: Path) -> str:
    """``runs/study/crps-s1`` -> ``crps``: runs that differ only in the seed suffix are one method."""
    name = run.name
    return name.rsplit("-s", 1)[0] if "-s" in name and name.rsplit("-s", 1)[1].isdigit() else name


def panels_with_data(runs: list[list[dict]], panels: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The panels some run logged a number for (a GRPO-only comparison has no replay-group panel)."""
    return [(k, t) for k, t in panels if any(isinstance(r.get(k), (int, float)) for rows in runs for r in rows)]


def plot_compare(run_dirs: list[Path], out: Path, x: str = "env_steps") -> dict[str, list[tuple[float, float]]]:
    """Methods against each other: runs grouped by ``run_label``, the mean over seeds (band = min..max),
    against cumulative env steps (``x="env_steps"``, the interaction budget) or the step. Fresh-group
    diagnostics are over every group the update saw (fresh and replay); replay groups alone get a panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[list[dict]]] = {}
    for run in run_dirs:
        groups.setdefault(run_label(run), []).append(read_metrics(run))
    panels = panels_with_data([rows for runs in groups.values() for rows in runs], COMPARE_PANELS)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    axes = axes[0]
    summary: dict[str, list[tuple[float, float]]] = {}
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = {label: palette[i % len(palette)] for i, label in enumerate(groups)}  # one colour per method
    for label, runs in groups.items():
        for ax, (key, title) in zip(axes, panels):
            series = []
            for rows in runs:
                total, pts = 0.0, []
                for r in rows:
                    total += float(r.get("env_steps", 0.0) or 0.0)
                    if isinstance(r.get(key), (int, float)):
                        pts.append((total if x == "env_steps" else r["step"], float(r[key])))
                series.append(pts)
            n = min(len(s) for s in series)
            ax.set_title(title, fontsize=9)
            if not n:
                continue
            xs = [sum(s[i][0] for s in series) / len(series) for i in range(n)]
            ys = [[s[i][1] for s in series] for i in range(n)]
            mean = [sum(v) / len(v) for v in ys]
            ax.plot(xs, mean, marker="o" if key.startswith("eval/") else None, label=f"{label} (n={len(runs)})",
                    color=colors[label])
            ax.fill_between(xs, [min(v) for v in ys], [max(v) for v in ys], alpha=0.15, color=colors[label])
            ax.set_xlabel("env steps (cumulative, training rollouts)" if x == "env_steps" else "step")
            if key == "eval/success":
                summary[label] = list(zip(xs, mean))
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return summary
