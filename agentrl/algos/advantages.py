"""Advantage estimators. Pure functions of rewards, groups and (for GAE) values; no model in sight.

Every registered estimator has one shape: it takes an ``AdvantageInput`` (episode rewards, group ids,
per-turn rewards, and, when it declares that it needs them, the critic's per-turn values or the env's
per-turn anchor states) and returns ``Advantages``: one advantage per turn of every episode, plus value
targets when it trains a critic. A new estimator is one function under ``@estimator(...)``.

The math lives in plain functions of tensors (``grpo``, ``gae``, ``gigpo``, ...), tested by hand: outcome
estimators take one scalar reward per trajectory and the group each trajectory belongs to (G rollouts
of one task from one start state) and return one advantage per trajectory. ``gae`` works on per-step
rewards and values. ``gigpo`` adds step-level advantages from groups of identical anchor states across
a group's trajectories.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from agentrl.registry import Registry, RegistryError

ESTIMATORS = Registry("advantage estimator", coerce=lambda name, fn: _as_estimator(name, fn))
EPS = 1e-6


@dataclass
class AdvantageInput:
    """What an estimator may read about a batch of N episodes."""

    rewards: torch.Tensor  # (N,) each episode's reward (what is optimized)
    group_ids: Sequence[str]  # the group of each episode (rollouts of one start state)
    turn_rewards: Sequence[Sequence[float]]  # each episode's reward split over its turns (sums to rewards)
    step_rewards: Sequence[Sequence[float]]  # each turn's env reward plus shaping penalties
    anchors: Sequence[Sequence[str]] | None = None  # env fingerprint before each turn (needs_anchors)
    values: Sequence[Sequence[float]] | None = None  # the critic's value before each turn (needs_values)
    # token-level estimators: the critic's value before each generated token of an episode (in order, env
    # tokens left out), and how many tokens each turn generated
    token_values: Sequence[Sequence[float]] | None = None
    turn_tokens: Sequence[Sequence[int]] | None = None
    gamma: float = 1.0
    lam: float = 1.0
    step_weight: float = 1.0  # GiGPO's weight of the step-level advantage
    whiten: bool = False  # normalize the batch's advantages to mean 0, std 1 (verl's GAE default)


@dataclass
class Advantages:
    per_turn: list[list[float]]  # one advantage per turn of every episode
    returns: list[list[float]] | None = None  # value targets per turn (estimators with a critic)
    # token-level estimators: per episode, one advantage and one value target per generated token
    per_token: list[list[float]] | None = None
    token_returns: list[list[float]] | None = None


@dataclass(frozen=True)
class Estimator:
    name: str
    fn: Callable[[AdvantageInput], Advantages]
    needs_values: bool = False  # the trainer builds a value head and fills ``values``
    needs_anchors: bool = False  # the recipe fills ``anchors`` from the env's fingerprints
    token_level: bool = False  # a critic over every generated token of a full-chat episode (trajectory level)

    def __call__(self, x: AdvantageInput) -> Advantages:
        if self.token_level and (x.token_values is None or x.turn_tokens is None):
            raise ValueError(f"estimator '{self.name}' needs the critic's per-token values")
        if self.needs_values and not self.token_level and x.values is None:
            raise ValueError(f"estimator '{self.name}' needs the critic's values")
        if self.needs_anchors and x.anchors is None:
            raise ValueError(f"estimator '{self.name}' needs per-turn anchor states")
        out = self.fn(x)
        if x.whiten:
            out.per_turn = whitened(out.per_turn)
            if out.per_token is not None:
                out.per_token = whitened(out.per_token)
        return out


def estimator(name: str, needs_values: bool = False, needs_anchors: bool = False, token_level: bool = False
              ) -> Callable[[Callable[[AdvantageInput], Advantages]], Callable[[AdvantageInput], Advantages]]:
    """Register ``fn(AdvantageInput) -> Advantages`` as ``algo.estimator: name`` (the function keeps its
    ``Estimator`` as ``fn.estimator``, so its import path names it with the same needs)."""
    def deco(fn: Callable[[AdvantageInput], Advantages]) -> Callable[[AdvantageInput], Advantages]:
        est = Estimator(name, fn, needs_values or token_level, needs_anchors, token_level)
        ESTIMATORS.register(name)(est)
        fn.estimator = est  # type: ignore[attr-defined]
        return fn
    return deco


def _as_estimator(path: str, obj: Any) -> Estimator:
    """What ``algo.estimator: package.module:name`` names: an ``Estimator``, a function registered with
    ``@estimator``, or a plain ``fn(AdvantageInput) -> Advantages`` (then it needs no critic or anchors)."""
    if isinstance(obj, Estimator):
        return obj
    if isinstance(getattr(obj, "estimator", None), Estimator):
        return obj.estimator
    if not callable(obj):
        raise RegistryError(f"advantage estimator '{path}' is a {type(obj).__name__}, not a function")
    return Estimator(path, obj)


def per_episode(adv: torch.Tensor, x: AdvantageInput) -> Advantages:
    """One advantage per episode, given to each of its turns."""
    return Advantages([[float(a)] * len(tr) for a, tr in zip(adv.tolist(), x.turn_rewards)])


def whitened(per_turn: list[list[float]], eps: float = 1e-8) -> list[list[float]]:
    """Advantages shifted and scaled to mean 0, std 1 over every turn of the batch."""
    flat = torch.tensor([a for row in per_turn for a in row], dtype=torch.float64)
    if flat.numel() < 2:
        return per_turn
    flat = (flat - flat.mean()) / (flat.std(unbiased=False) + eps)
    out, k = [], 0
    for row in per_turn:
        out.append(flat[k:k + len(row)].tolist())
        k += len(row)
    return out


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


def grpo(rewards: torch.Tensor, group_ids: Sequence[str], eps: float = EPS, **_: object) -> torch.Tensor:
    """(r - mean_group) / (std_group + eps)."""
    adv = torch.zeros_like(rewards)
    for idx in _groups(group_ids).values():
        adv[idx] = _normalized(rewards[idx], True, eps)
    return adv


def dr_grpo(rewards: torch.Tensor, group_ids: Sequence[str], **_: object) -> torch.Tensor:
    """Dr. GRPO: r - mean_group, no std division (no difficulty bias)."""
    adv = torch.zeros_like(rewards)
    for idx in _groups(group_ids).values():
        adv[idx] = _normalized(rewards[idx], False, 0.0)
    return adv


def rloo(rewards: torch.Tensor, group_ids: Sequence[str], **_: object) -> torch.Tensor:
    """REINFORCE leave-one-out: r_i - mean of the other G-1 rewards of the group, i.e. G/(G-1) times
    r_i - mean_group."""
    adv = torch.zeros_like(rewards)
    for idx in _groups(group_ids).values():
        if len(idx) > 1:
            adv[idx] = _normalized(rewards[idx], False, 0.0) * (len(idx) / (len(idx) - 1))
    return adv


def reinforce_pp(rewards: torch.Tensor, group_ids: Sequence[str] | None = None, eps: float = EPS,
                 **_: object) -> torch.Tensor:
    """REINFORCE++: returns normalized over the whole batch (no per-prompt baseline)."""
    return _normalized(rewards, True, eps)


def reinforce_pp_baseline(rewards: torch.Tensor, group_ids: Sequence[str], eps: float = EPS,
                          **_: object) -> torch.Tensor:
    """REINFORCE++ with a group baseline (REINFORCE++-baseline): subtract the group mean, then normalize
    by the std of the whole batch (not the group's: no difficulty bias from small-variance groups)."""
    centred = dr_grpo(rewards, group_ids).double()
    if bool((centred == 0).all()):
        return torch.zeros_like(rewards)
    return (centred / (_std(centred) + eps)).to(rewards.dtype)


@estimator("grpo")
def _grpo(x: AdvantageInput) -> Advantages:
    return per_episode(grpo(x.rewards, x.group_ids), x)


@estimator("dr_grpo")
def _dr_grpo(x: AdvantageInput) -> Advantages:
    return per_episode(dr_grpo(x.rewards, x.group_ids), x)


@estimator("rloo")
def _rloo(x: AdvantageInput) -> Advantages:
    return per_episode(rloo(x.rewards, x.group_ids), x)


@estimator("reinforce_pp")
def _reinforce_pp(x: AdvantageInput) -> Advantages:
    return per_episode(reinforce_pp(x.rewards), x)


@estimator("reinforce_pp_baseline")
def _reinforce_pp_baseline(x: AdvantageInput) -> Advantages:
    return per_episode(reinforce_pp_baseline(x.rewards, x.group_ids), x)


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


@estimator("gae", needs_values=True)
def _gae(x: AdvantageInput) -> Advantages:
    """Turn-level GAE per episode; the value after the last turn is 0."""
    per_turn, returns = [], []
    for tr, v in zip(x.turn_rewards, x.values):
        adv, ret = gae(torch.tensor([list(tr)], dtype=torch.float64), torch.tensor([list(v)], dtype=torch.float64),
                       x.gamma, x.lam)
        per_turn.append(adv[0].tolist())
        returns.append(ret[0].tolist())
    return Advantages(per_turn, returns)


@estimator("gae_token", token_level=True)
def _gae_token(x: AdvantageInput) -> Advantages:
    """RAGEN's StarPO-PPO: GAE over every generated token of the whole multi-turn episode, env tokens left
    out (they are not actions), each turn's reward on its last generated token, a value per token."""
    per_turn, per_token, returns = [], [], []
    for tr, counts, v in zip(x.turn_rewards, x.turn_tokens, x.token_values):
        if not v:
            per_turn.append([0.0] * len(tr))
            per_token.append([])
            returns.append([])
            continue
        rewards, end = [0.0] * len(v), 0
        for r, c in zip(tr, counts):
            end += c
            rewards[max(end, 1) - 1] += r  # a turn that generated nothing: on the nearest generated token
        adv, ret = gae(torch.tensor([rewards], dtype=torch.float64), torch.tensor([list(v)], dtype=torch.float64),
                       x.gamma, x.lam)
        per_token.append(adv[0].tolist())
        returns.append(ret[0].tolist())
        starts = [sum(counts[:k]) for k in range(len(counts))]  # each turn's first token (for per-turn logs)
        per_turn.append([per_token[-1][s] if c else 0.0 for s, c in zip(starts, counts)])
    return Advantages(per_turn, per_token=per_token, token_returns=returns)


def discounted_returns(step_rewards: Sequence[float], gamma: float) -> list[float]:
    out, g = [0.0] * len(step_rewards), 0.0
    for t in reversed(range(len(step_rewards))):
        g = step_rewards[t] + gamma * g
        out[t] = g
    return out


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
            centred = _normalized(torch.tensor([returns[i][t] for i, t in members]), normalize_std, eps)
            for (i, t), a in zip(members, centred):
                out[i][t] += step_weight * float(a)
    return out


@estimator("gigpo", needs_anchors=True)
def _gigpo(x: AdvantageInput) -> Advantages:
    """Step returns from the env's per-turn rewards (shaped rewards give step credit inside an all-failed
    group), the episode term from the episode rewards."""
    per_turn = gigpo(x.rewards, x.group_ids, x.step_rewards, x.anchors, x.gamma, x.step_weight)
    return Advantages([a.tolist() for a in per_turn])


@estimator("gigpo_dr", needs_anchors=True)
def _gigpo_dr(x: AdvantageInput) -> Advantages:
    """GiGPO without std normalization (episode and step terms centred only): SPEAR's "GiGPO w/o std"."""
    per_turn = gigpo(x.rewards, x.group_ids, x.step_rewards, x.anchors, x.gamma, x.step_weight, normalize_std=False)
    return Advantages([a.tolist() for a in per_turn])


def assign(traj_adv: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Spread one advantage per trajectory over its units (turns or tokens): every unit gets it."""
    return [torch.full((n,), float(a)) for a, n in zip(traj_adv, lengths)]
