"""Extract executable actions from model text.

Never raises on model output: a missing or malformed answer is reported through ``ParsedTurn``
(``format_ok=False``, ``error``) so the trainer can apply a format penalty and the env can be stepped
with nothing, or with the env's own handling of an invalid command.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from agentrl.envs.base import sanitize_action


@dataclass
class ParsedTurn:
    actions: list[str] = field(default_factory=list)
    format_ok: bool = False
    error: str = ""
    think: str = ""
    over_budget: bool = False  # more actions than the per-turn budget; the extra ones were dropped
    inadmissible: list[str] = field(default_factory=list)  # actions not in the env's admissible list

    @property
    def valid(self) -> bool:
        return self.format_ok and bool(self.actions)


def tag_span(text: str, tag: str) -> str | None:
    """Content of the last complete <tag>...</tag>; an unclosed final <tag> counts too, because
    generation usually stops on the closing tag as a stop string. Linear time: two reverse searches
    (a regex with a lazy group was quadratic: 7.8 s on "<action>" x 8000)."""
    low, open_tag, close_tag = text.lower(), f"<{tag.lower()}>", f"</{tag.lower()}>"
    end = low.rfind(close_tag)
    if end >= 0:
        start = low.rfind(open_tag, 0, end)
        if start >= 0:
            return text[start + len(open_tag):end]
    start = low.rfind(open_tag)
    return text[start + len(open_tag):] if start >= 0 and low.find(close_tag, start) < 0 else None


def clean_action(action: str) -> str:
    """The action without control characters or lone surrogates (``sanitize_action``, which every env's
    ``step`` applies too), whitespace runs collapsed."""
    return re.sub(r"\s+", " ", sanitize_action(action)).strip()


def parse_turn(text: str, answer_tag: str = "action", max_actions: int = 1, separator: str = "||",
               require_think: bool = False, admissible: list[str] | None = None,
               numbered: list[str] | None = None) -> ParsedTurn:
    """``numbered``: the actions as the prompt numbered them (1-based); an answer that is such a number
    stands for that action."""
    out = ParsedTurn()
    think = tag_span(text, "think")
    out.think = (think or "").strip()
    body = tag_span(text, answer_tag)
    if body is None:
        out.error = f"no <{answer_tag}>...</{answer_tag}> in the response"
        return out
    parts = [p.strip() for p in body.split(separator.strip())] if max_actions > 1 else [body.strip()]
    parts = [c for c in (clean_action(p) for p in parts) if c]
    if not parts:
        out.error = f"empty <{answer_tag}>"
        return out
    if len(parts) > max_actions:
        parts, out.over_budget = parts[:max_actions], True
    if numbered:
        parts = [numbered[int(p) - 1] if p.isdigit() and 1 <= int(p) <= len(numbered) else p for p in parts]
    if admissible is not None:
        canon = {a.lower(): a for a in admissible}
        out.inadmissible = [p for p in parts if p.lower() not in canon]
        parts = [canon.get(p.lower(), p) for p in parts]
    out.actions = parts
    out.format_ok = not (require_think and think is None)
    if not out.format_ok:
        out.error = "missing <think>...</think>"
    return out
