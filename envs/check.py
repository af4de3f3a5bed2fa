"""Self-checks of an env: the expert solves tasks, replay-prefix restore is exact, tampering is caught.

Used by ``agentrl envs check`` (the figures in the docs) and, on fewer tasks, by the test suite.
"""
from __future__ import annotations

import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from agentrl.envs.base import TextEnv
from agentrl.envs.registry import make
from agentrl.envs.replay import DivergenceError, Trace, replay, run_expert

GARBAGE_ACTION = "xyzzy plugh"  # no env accepts this; it must change the trajectory


@dataclass
class CheckReport:
    env: str
    expert_tasks: int = 0
    expert_wins: int = 0
    expert_score: float = 0.0
    expert_steps: float = 0.0
    per_category: dict[str, list[int]] = field(default_factory=dict)  # category -> [wins, tasks]
    replay_checked: int = 0
    replay_failures: list[str] = field(default_factory=list)
    tamper_checked: int = 0
    tamper_missed: list[str] = field(default_factory=list)
    replay_skipped: int = 0  # tasks the engine cannot replay deterministically (env.replay_deterministic)
    snapshot_checked: int = 0
    snapshot_failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def success_rate(self) -> float:
        return self.expert_wins / max(1, self.expert_tasks)

    @property
    def ok(self) -> bool:
        return not (self.replay_failures or self.tamper_missed or self.snapshot_failures)

    def summary(self) -> str:
        lines = [f"{self.env}: expert success {self.expert_wins}/{self.expert_tasks} = {self.success_rate:.1%}, "
                 f"mean score {self.expert_score:.3f}, mean steps {self.expert_steps:.1f}"]
        if len(self.per_category) > 1:
            lines.append("  per category: " + ", ".join(f"{c} {w}/{n}"
                                                        for c, (w, n) in sorted(self.per_category.items())))
        lines.append("  replay-prefix restore exact at random cut points: "
                     f"{self.replay_checked - len(self.replay_failures)}/{self.replay_checked}")
        lines.append(f"  altered prefix raised DivergenceError: {self.tamper_checked - len(self.tamper_missed)}"
                     f"/{self.tamper_checked}")
        if self.replay_skipped:
            lines.append(f"  replay checks skipped on {self.replay_skipped} task(s) the engine cannot replay "
                         "deterministically")
        if self.snapshot_checked:
            lines.append(f"  native snapshot/restore exact: {self.snapshot_checked - len(self.snapshot_failures)}"
                         f"/{self.snapshot_checked}")
        for f in self.replay_failures + self.tamper_missed + self.snapshot_failures:
            lines.append(f"  FAIL {f}")
        lines.append(f"  ({self.seconds:.1f}s)")
        return "\n".join(lines)


def check_env(name: str, n_expert: int = 50, n_replay: int = 20, split: str = "train", seed: int = 0,
              env_kwargs: dict[str, Any] | None = None, verbose: bool = False) -> CheckReport:
    t0 = time.time()
    rng = random.Random(seed)
    env = make(name, **(env_kwargs or {}))
    other = make(name, **(env_kwargs or {}))  # replays run in a separate instance: nothing carried over
    rep = CheckReport(name)
    try:
        tasks = env.tasks(split)
        sample = rng.sample(tasks, min(n_expert, len(tasks)))
        cats: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        traces: list[tuple[Trace, list[str]]] = []
        scores, steps = [], []
        for k, task in enumerate(sample):
            trace, observations, info = run_expert(env, task.task_id, seed=seed + k)
            won = bool(info.get("won"))
            rep.expert_tasks += 1
            rep.expert_wins += won
            scores.append(float(info.get("score", 0.0)))
            steps.append(len(trace.actions))
            cats[task.category or "all"][0] += won
            cats[task.category or "all"][1] += 1
            if len(traces) < n_replay:
                traces.append((trace, observations))
            if verbose:
                print(f"  {task.task_id}: won={won} steps={len(trace.actions)}", flush=True)
        rep.expert_score = sum(scores) / max(1, len(scores))
        rep.expert_steps = sum(steps) / max(1, len(steps))
        rep.per_category = {c: list(v) for c, v in cats.items()}
        for trace, observations in traces:
            if not env.replay_deterministic(trace.task_id):
                rep.replay_skipped += 1
                continue
            _check_replay(other, trace, observations, rng, rep)
            _check_tamper(other, trace, rng, rep)
            if env.supports_snapshot:
                _check_snapshot(env, trace, observations, rng, rep)
    finally:
        env.close()
        other.close()
    rep.seconds = time.time() - t0
    return rep


def _check_replay(env: TextEnv, trace: Trace, observations: list[str], rng: random.Random, rep: CheckReport) -> None:
    t = rng.randint(0, len(trace.actions))
    rep.replay_checked += 1
    try:
        obs, info = replay(env, trace, t)
    except DivergenceError as e:
        rep.replay_failures.append(str(e))
        return
    if env.canonical_obs(obs) != env.canonical_obs(observations[t]):
        rep.replay_failures.append(f"{trace.task_id} step {t}: observation differs after replay")


def _check_tamper(env: TextEnv, trace: Trace, rng: random.Random, rep: CheckReport) -> None:
    if not trace.actions:
        return
    j = rng.randrange(len(trace.actions))
    bad = Trace(trace.env, trace.task_id, trace.seed, list(trace.actions), list(trace.fingerprints))
    bad.actions[j] = GARBAGE_ACTION
    rep.tamper_checked += 1
    try:
        replay(env, bad, len(bad.actions))
    except DivergenceError as e:
        if e.step < j + 1:
            rep.tamper_missed.append(f"{trace.task_id}: divergence reported at step {e.step}, "
                                     f"before the edit at {j + 1}")
        return
    rep.tamper_missed.append(f"{trace.task_id}: altered action {j} replayed without a divergence error")


def _check_snapshot(env: TextEnv, trace: Trace, observations: list[str], rng: random.Random, rep: CheckReport) -> None:
    """Snapshot at t, run ahead, restore, and the state at t and the recorded future must come back."""
    t = rng.randint(0, len(trace.actions))
    replay(env, trace, t)
    snap = env.snapshot()
    for a in trace.actions[t:]:
        if env.done:
            break
        env.step(a)
    env.restore(snap)
    rep.snapshot_checked += 1
    same_obs = env.canonical_obs(env.last_obs) == env.canonical_obs(observations[t])
    if not same_obs or env.last_info["fingerprint"] != trace.fingerprints[t]:
        rep.snapshot_failures.append(f"{trace.task_id} step {t}: restored state differs")
        return
    for i, a in enumerate(trace.actions[t:], start=t):
        obs, *_ , info = env.step(a)
        if info["fingerprint"] != trace.fingerprints[i + 1]:
            rep.snapshot_failures.append(f"{trace.task_id}: continuation after restore diverged at step {i + 1}")
            return
