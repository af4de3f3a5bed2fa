"""Replay-prefix reset: rebuild any intermediate state from (task, seed, actions[:t]).

Works for every env: reset the task with its seed and re-apply the recorded actions. Each replayed
step's fingerprint (observation text plus the env's hidden state, e.g. its RNG) must equal the one
recorded when the trajectory was collected; otherwise ``DivergenceError`` names env, task and step.
Stochastic envs replay exactly because their RNG is seeded by the episode seed and is part of the
fingerprint; pass ``reseed`` to give the continuation a fresh stream (G rollouts from one state).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from agentrl.envs.base import EnvError, TextEnv


class DivergenceError(EnvError):
    """A replayed prefix did not reproduce the recorded observation."""

    def __init__(self, env: str, task_id: str, step: int, expected: str, got: str, obs: str = ""):
        self.env, self.task_id, self.step, self.expected, self.got = env, task_id, step, expected, got
        super().__init__(
            f"replay diverged: env '{env}', task '{task_id}', step {step}: expected fingerprint {expected}, "
            f"got {got}" + (f"; observation now: {obs[:160]!r}" if obs else ""))
        self.obs = obs

    def __reduce__(self):  # picklable, so env worker processes can hand it to the caller
        return type(self), (self.env, self.task_id, self.step, self.expected, self.got, self.obs)


@dataclass
class Trace:
    """What a restore needs. ``fingerprints[i]`` is the state after ``i`` actions (0 = after reset)."""

    env: str
    task_id: str
    seed: int
    actions: list[str] = field(default_factory=list)
    fingerprints: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.fingerprints and len(self.fingerprints) != len(self.actions) + 1:
            raise ValueError(f"trace of {len(self.actions)} actions needs {len(self.actions) + 1} fingerprints, "
                             f"got {len(self.fingerprints)}")

    def prefix(self, t: int) -> "Trace":
        return Trace(self.env, self.task_id, self.seed, self.actions[:t], self.fingerprints[:t + 1])

    def to_dict(self) -> dict[str, Any]:
        return dict(env=self.env, task_id=self.task_id, seed=self.seed, actions=list(self.actions),
                    fingerprints=list(self.fingerprints))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trace":
        return cls(d["env"], d["task_id"], int(d["seed"]), list(d["actions"]), list(d["fingerprints"]))


def replay(env: TextEnv, trace: Trace, t: int | None = None, reseed: int | None = None,
           verify: bool = True) -> tuple[str, dict[str, Any]]:
    """Reset ``env`` to ``trace.task_id`` and re-apply ``trace.actions[:t]``; return (obs, info) at step t."""
    t = len(trace.actions) if t is None else t
    if not 0 <= t <= len(trace.actions):
        raise EnvError(f"replay cut point {t} outside 0..{len(trace.actions)} for task '{trace.task_id}'")
    obs, info = env.reset(trace.task_id, trace.seed)
    _check(env, trace, 0, obs, info, verify)
    for i in range(t):
        if env.done:  # a trace without fingerprints (nothing to verify) made this an IndexError
            raise DivergenceError(env.name, trace.task_id, i + 1,
                                  trace.fingerprints[i + 1] if verify and trace.fingerprints else "(none recorded)",
                                  f"<the episode ended after {i} of the trace's {len(trace.actions)} actions>")
        obs, _, _, _, info = env.step(trace.actions[i])
        _check(env, trace, i + 1, obs, info, verify)
    if reseed is not None:
        env.reseed(reseed)
    return obs, info


def _check(env: TextEnv, trace: Trace, i: int, obs: str, info: dict[str, Any], verify: bool) -> None:
    if verify and trace.fingerprints and info["fingerprint"] != trace.fingerprints[i]:
        raise DivergenceError(env.name, trace.task_id, i, trace.fingerprints[i], info["fingerprint"], obs)


def play(env: TextEnv, task_id: str, seed: int, next_action: Callable[[int], str | None]
         ) -> tuple[Trace, list[str], list[dict[str, Any]]]:
    """Reset, then step with ``next_action(step)`` until the episode ends or it returns None; returns the
    trace, the observations and the info dicts (index 0 = after reset)."""
    obs, info = env.reset(task_id, seed)
    trace = Trace(env.name, task_id, seed, [], [info["fingerprint"]])
    observations, infos = [obs], [info]
    while not env.done:
        a = next_action(len(trace.actions))
        if a is None:
            break
        obs, _, _, _, info = env.step(a)
        trace.actions.append(a)
        trace.fingerprints.append(info["fingerprint"])
        observations.append(obs)
        infos.append(info)
    return trace, observations, infos


def record(env: TextEnv, task_id: str, seed: int, actions: list[str]) -> tuple[Trace, list[str]]:
    """Play ``actions`` from a fresh reset (stopping if the episode ends); return the trace and observations."""
    trace, observations, _ = play(env, task_id, seed, lambda k: actions[k] if k < len(actions) else None)
    return trace, observations


def run_expert(env: TextEnv, task_id: str, seed: int = 0, max_steps: int | None = None
               ) -> tuple[Trace, list[str], dict[str, Any]]:
    """Roll out the env's expert from a fresh reset; return trace, observations and the final info."""
    trace, observations, infos = expert_episode(env, task_id, seed, max_steps)
    return trace, observations, infos[-1]


def expert_episode(env: TextEnv, task_id: str, seed: int = 0, max_steps: int | None = None
                   ) -> tuple[Trace, list[str], list[dict[str, Any]]]:
    """The expert's episode with every step's info (admissible actions included)."""
    limit = max_steps or env.max_steps
    return play(env, task_id, seed, lambda k: env.expert_action() if k < limit else None)
