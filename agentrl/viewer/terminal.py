"""`agentrl show`: a step's recorded groups, or one group's episodes turn by turn, with rich."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text


def _num(x: Any, fmt: str = "{:+.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _status(e: dict[str, Any]) -> str:
    if e["dropped"]:
        return "dropped"
    if e["filtered"]:
        return f"filtered ({e['filtered']})"
    return ""


def show(run: Any, step: int, group: str | None, split: str = "train", console: Console | None = None) -> None:
    con = console or Console()
    rec = run.step(step, split)
    groups = rec.groups()
    con.print(f"[bold]{run.name}[/] {split} step {rec.step}: {len(groups)} of {rec.groups_total} groups recorded, "
              f"{len(rec.episodes)} of {rec.episodes_total} episodes")
    if group is None:
        t = Table("#", "group", "task", "episodes", "won", "reward (each)", "advantage (first turn)", "note")
        for i, (gid, eps) in enumerate(groups.items()):
            t.add_row(str(i), gid, eps[0]["task_id"], str(len(eps)), f"{sum(e['won'] for e in eps)}/{len(eps)}",
                      " ".join(_num(e["reward"], "{:.2f}") for e in eps),
                      " ".join(_num(e["turns"][0]["advantage"] if e["turns"] else None) for e in eps),
                      ", ".join(sorted({_status(e) for e in eps} - {""})))
        con.print(t)
        con.print("a group's episodes: --group INDEX (or its id)")
        return
    ids = list(groups)
    gid = ids[int(group)] if group.isdigit() and int(group) < len(ids) else group
    if gid not in groups:
        raise KeyError(f"step {rec.step} has no recorded group {group!r} (indexes 0..{len(ids) - 1}, or one of "
                       f"{', '.join(ids[:4])}{' ...' if len(ids) > 4 else ''})")
    for k, e in enumerate(groups[gid]):
        head = (f"episode {k}: task {e['task_id']} ({e['env']}{', ' + e['category'] if e['category'] else ''}) "
                f"{'WON' if e['won'] else 'lost'}, reward {_num(e['reward'], '{:.3f}')}, {len(e['turns'])} turns"
                + (f", {_status(e)}" if _status(e) else "") + (", truncated" if e["truncated"] else ""))
        body = Text()
        if e["start_index"]:
            body.append(f"restored prefix ({e['start_index']} steps): {' | '.join(e['prefix_actions'])}\n",
                        style="magenta")
        body.append(f"obs: {e['initial_observation'].strip()[:400]}\n", style="dim")
        for i, t in enumerate(e["turns"]):
            body.append(f"turn {i + 1} ", style="bold")
            body.append(f"[adv {_num(t['advantage'])}, r {_num(t['reward'], '{:.2f}')}, v{t['policy_version']}, "
                        f"logp {_num(t['logprob_mean'], '{:.2f}')}]\n", style="cyan")
            body.append(f"  agent: {t['text'].strip()}\n", style="green" if t["format_ok"] else "red")
            if t["actions"]:
                body.append(f"  actions: {' || '.join(t['actions'])}\n", style="yellow")
            for call, res in zip(t.get("tool_calls", []), t.get("tool_results", [])):
                body.append(f"  tool {call} -> {str(res)[:200]}\n", style="blue")
            body.append(f"  env: {t['observation'].strip()[:400]}\n", style="dim")
        con.print(Panel(body, title=head, title_align="left"))
