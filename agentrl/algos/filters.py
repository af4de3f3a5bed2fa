"""Batch filters over episodes, applied before advantages are turned into a training batch.

Every registered filter has one signature, ``f(episodes, ctx: FilterContext) -> (kept, n_dropped)``;
the count is logged as ``filtered_<name>``.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from agentrl.registry import Registry
from agentrl.types import Episode

FILTERS = Registry("filter")


@dataclass
class FilterContext:
    reward: Callable[[Episode], float] = field(default=lambda e: e.total_reward)  # the recipe's episode reward
    variance_keep: float = 0.75  # ``variance``: the fraction of groups kept (algo.variance_keep)


MIN_STD = 1e-12  # a group whose rewards' std is at most this has no group-relative gradient


def group_variance(rewards: Sequence[float]) -> float:
    if len(rewards) < 2:
        return 0.0
    m = sum(rewards) / len(rewards)
    return sum((r - m) ** 2 for r in rewards) / len(rewards)


def group_std(rewards: Sequence[float]) -> float:
    return math.sqrt(group_variance(rewards))


@FILTERS.register("variance")
def variance_filter(episodes: list[Episode], ctx: FilterContext | None = None) -> tuple[list[Episode], int]:
    """StarPO-S / Dr.BoT: keep the top ``ctx.variance_keep`` fraction of groups by within-group reward std.

    Groups with equal std are ranked by group id so the cut is deterministic; at least one group stays."""
    ctx = ctx or FilterContext()
    reward, keep_top = ctx.reward, ctx.variance_keep
    groups: dict[str, list[Episode]] = defaultdict(list)
    for e in episodes:
        groups[e.group_id].append(e)
    ranked = sorted(groups, key=lambda g: (-group_std([reward(e) for e in groups[g]]), g))
    n_keep = max(1, math.ceil(keep_top * len(ranked))) if ranked else 0
    kept_ids = set(ranked[:n_keep])
    kept = [e for e in episodes if e.group_id in kept_ids]
    return kept, len(episodes) - len(kept)


@FILTERS.register("zero_variance")
def zero_variance_filter(episodes: list[Episode], ctx: FilterContext | None = None) -> tuple[list[Episode], int]:
    """DAPO's dynamic-sampling filter (the resampling is ``rollout.fill_groups``): drop groups whose
    rewards are all equal.
    Their group-relative advantages are zero, so they add no gradient, only compute (and they dilute a
    token-mean loss)."""
    kept_ids = varying_groups(episodes, (ctx or FilterContext()).reward)
    kept = [e for e in episodes if e.group_id in kept_ids]
    return kept, len(episodes) - len(kept)


def varying_groups(episodes: list[Episode], reward: Callable[[Episode], float]) -> set[str]:
    """Ids of the groups whose episodes got different rewards: the ones with a group-relative gradient."""
    groups: dict[str, list[float]] = defaultdict(list)
    for e in episodes:
        groups[e.group_id].append(reward(e))
    return {g for g, rs in groups.items() if group_std(rs) > MIN_STD}


def informative_groups(episodes: list[Episode], reward: Callable[[Episode], float]) -> int:
    """Groups whose (non-dropped) rollouts got different rewards: the ones a group-relative estimator
    learns from. Dynamic sampling counts these."""
    return len(varying_groups([e for e in episodes if not e.dropped], reward))


@FILTERS.register("overlong")
def overlong_filter(episodes: list[Episode], ctx: FilterContext | None = None) -> tuple[list[Episode], int]:
    """Drop episodes with a response cut at the token limit (its end was never sampled)."""
    kept = [e for e in episodes if all(t.finish_reason != "length" for t in e.turns)]
    return kept, len(episodes) - len(kept)


@FILTERS.register("void_turn")
def void_turn_filter(episodes: list[Episode], ctx: FilterContext | None = None) -> tuple[list[Episode], int]:
    """Drop episodes with a turn that executed no action (SPEAR/Dr.BoT void turns)."""
    kept = [e for e in episodes if all(t.actions for t in e.turns)]
    return kept, len(episodes) - len(kept)


@FILTERS.register("invalid_format")
def invalid_format_filter(episodes: list[Episode], ctx: FilterContext | None = None) -> tuple[list[Episode], int]:
    kept = [e for e in episodes if all(t.format_ok for t in e.turns)]
    return kept, len(episodes) - len(kept)


@FILTERS.register("dropped")
def dropped_filter(episodes: list[Episode], ctx: FilterContext | None = None) -> tuple[list[Episode], int]:
    """Episodes whose env worker was lost and could not be rebuilt never reach training."""
    kept = [e for e in episodes if not e.dropped]
    return kept, len(episodes) - len(kept)
