"""Advantage estimators. Pure functions of rewards, groups and (for GAE) values; no model in sight.

Outcome estimators take one scalar reward per trajectory and the group each trajectory belongs to (G
rollouts of one task from one start state) and return one advantage per trajectory; ``assign`` then
spreads it over turns or tokens. ``gae`` works on per-step rewards and values. ``gigpo`` adds
step-level advantages from groups of identical anchor states across a group's trajectories.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch

from agentrl.registry import Registry

ESTIMATORS = Registry("advantage estimator")
EPS = 1e-6


def _groups(group_ids: Sequence[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        out[g].append(i)
    return out


def _std(x: torch.Tensor) -> torch.Tensor:
    # population std (ddof=0): a group of one gets std 0, hence advantage 0 after centring
    return x.std(unbiased=False) if x.numel() > 1 else torch.zeros((), dtype=x.dtype)


def _normalized(r: torch.Tensor, by_std: bool, eps: float) -> torch.Tensor:
    """(r - mean) [/ (std + eps)] in float64, and exactly 0 for equal rewards: a float32 mean of eight
    0.1s is off by an ulp, which the division by (0 + eps) used to turn into an advantage of ~-0.007."""
    if r.numel() == 0 or bool((r == r[0]).all()):
        return torch.zeros_like(r)
    x = r.double()
    out = x - x.mean()
    if by_std:
        out = out / (_std(x) + eps)
    return out.to(r.dtype)


@ESTIMATORS.register("grpo")
def grpo(rewards: torch.Tensor, group_ids: Sequence[str], eps: float = EPS, **_: object) -> torch.Tensor:
    """(r - mean_group) / (std_group + eps)."""
    adv = torch.zeros_like(rewards)
    for idx in _groups(group_ids).values():
        adv[idx] = _normalized(rewards[idx], True, eps)
    return adv


@ESTIMATORS.register("dr_grpo")
def dr_grpo(rewards: torch.Tensor, group_ids: Sequence[str], **_: object) -> torch.Tensor:
    """Dr. GRPO: r - mean_group, no std division (no difficulty bias)."""
    adv = torch.zeros_like(rewards)
    for idx in _groups(group_ids).values():
        adv[idx] = _normalized(rewards[idx], False, 0.0)
    return adv


@ESTIMATORS.register("rloo")
def rloo(rewards: torch.Tensor, group_ids: Sequence[str], **_: object) -> torch.Tensor:
    """REINFORCE leave-one-out: r_i - mean of the other G-1 rewards of the group, i.e. G/(G-1) times
    r_i - mean_group."""
    adv = torch.zeros_like(rewards)
    for idx in _groups(group_ids).values():
        if len(idx) > 1:
            adv[idx] = _normalized(rewards[idx], False, 0.0) * (len(idx) / (len(idx) - 1))
    return adv


@ESTIMATORS.register("reinforce_pp")
def reinforce_pp(rewards: torch.Tensor, group_ids: Sequence[str] | None = None, eps: float = EPS,
                 **_: object) -> torch.Tensor:
    """REINFORCE++: returns normalized over the whole batch (no per-prompt baseline)."""
    return _normalized(rewards, True, eps)


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, lam: float = 1.0,
        mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the last dim; returns (advantages, returns).

    ``values[..., t]`` estimates the return from step t; the value after the last real step is 0.
    ``mask`` marks real steps (right padding)."""
    mask = torch.ones_like(rewards) if mask is None else mask.to(rewards.dtype)
    T = rewards.shape[-1]
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[..., 0])
    for t in reversed(range(T)):
        next_v = values[..., t + 1] * mask[..., t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[..., t] + gamma * next_v - values[..., t]
        last = (delta + gamma * lam * last * (mask[..., t + 1] if t + 1 < T else 0.0)) * mask[..., t]
        adv[..., t] = last
    return adv, (adv + values) * mask


ESTIMATORS.register("gae")(gae)


def discounted_returns(step_rewards: Sequence[float], gamma: float) -> list[float]:
    out, g = [0.0] * len(step_rewards), 0.0
    for t in reversed(range(len(step_rewards))):
        g = step_rewards[t] + gamma * g
        out[t] = g
    return out


@ESTIMATORS.register("gigpo")
def gigpo(rewards: torch.Tensor, group_ids: Sequence[str], step_rewards: Sequence[Sequence[float]],
          anchors: Sequence[Sequence[str]], gamma: float = 0.95, step_weight: float = 1.0, eps: float = EPS,
          normalize_std: bool = True, **_: object) -> list[torch.Tensor]:
    """GiGPO: per step, episode advantage (GRPO over the group) + ``step_weight`` x step advantage.

    The step advantage compares the discounted return from a state with the returns from the *same*
    state (same anchor, i.e. env fingerprint) reached in other trajectories of the group. Returns one
    tensor of per-step advantages per trajectory."""
    episode = grpo(rewards, group_ids, eps) if normalize_std else dr_grpo(rewards, group_ids)
    returns = [discounted_returns(sr, gamma) for sr in step_rewards]
    out = [torch.full((len(sr),), float(episode[i])) for i, sr in enumerate(step_rewards)]
    for idx in _groups(group_ids).values():
        by_anchor: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for i in idx:
            for t, a in enumerate(anchors[i]):
                by_anchor[a].append((i, t))
        for members in by_anchor.values():
            r = torch.tensor([returns[i][t] for i, t in members])
            centred = r - r.mean()
            if normalize_std:
                centred = centred / (_std(r) + eps)
            for (i, t), a in zip(members, centred):
                out[i][t] += step_weight * float(a)
    return out


def assign(traj_adv: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Spread one advantage per trajectory over its units (turns or tokens): every unit gets it."""
    return [torch.full((n,), float(a)) for a, n in zip(traj_adv, lengths)]
