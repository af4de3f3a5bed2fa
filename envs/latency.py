"""Any env with a random per-step delay (``env: latency:<env>``), to measure rollout loops on slow envs.

Real agent envs step slowly and unevenly (a JVM, a search engine, a planner); this wrapper gives any
registered env that property reproducibly, so loop throughput can be compared without one engine's speed.
Each ``step`` sleeps a delay drawn from ``latency`` ("fixed" | "uniform" on [0, 2 x latency_s] |
"lognormal" with median latency_s | "pareto" with scale latency_s and shape latency_alpha), capped at
latency_max_s. The draw is seeded by (latency_seed, task, episode seed, step), so the same episode gets
the same delays in whichever slot, process or loop mode it runs. Observations, rewards and fingerprints
are the wrapped env's, untouched. Other options go to the wrapped env.
"""
from __future__ import annotations

import math
import random
import time
import zlib
from typing import Any

from agentrl.envs.base import EnvError, PromptSpec, Task, TextEnv
from agentrl.seeds import mix_seed

KINDS = ("fixed", "uniform", "lognormal", "pareto")


class LatencyEnv(TextEnv):
    name = "latency"

    def __init__(self, inner: str, latency: str = "lognormal", latency_s: float = 0.05, latency_sigma: float = 1.0,
                 latency_alpha: float = 1.5, latency_max_s: float = 30.0, latency_seed: int = 0, **kwargs: Any):
        from agentrl.envs.registry import make

        super().__init__()
        if latency not in KINDS:
            raise EnvError(f"env option latency must be one of {', '.join(KINDS)}, got {latency!r}")
        for key, v in (("latency_s", latency_s), ("latency_sigma", latency_sigma), ("latency_max_s", latency_max_s)):
            if not (v >= 0 and math.isfinite(v)):
                raise EnvError(f"env option {key} must be a finite number >= 0, got {v!r}")
        if not latency_alpha > 0:
            raise EnvError(f"env option latency_alpha must be > 0, got {latency_alpha!r}")
        self.kind, self.scale, self.sigma, self.alpha = latency, float(latency_s), float(latency_sigma), latency_alpha
        self.cap, self.delay_seed = float(latency_max_s), int(latency_seed)
        self.env = make(inner, **kwargs)
        self.max_steps = self.env.max_steps
        self.supports_snapshot, self.stochastic = self.env.supports_snapshot, self.env.stochastic  # type: ignore[misc]
        self.slept_s = 0.0  # delays served so far (for benchmarks' bookkeeping)

    def delay(self, task_id: str, seed: int, step: int) -> float:
        """The delay of ``step`` (1-based) of the episode (task_id, seed)."""
        rng = random.Random(mix_seed(self.delay_seed, zlib.crc32(task_id.encode()), seed, step))
        if self.kind == "fixed":
            d = self.scale
        elif self.kind == "uniform":
            d = rng.uniform(0.0, 2.0 * self.scale)
        elif self.kind == "lognormal":
            d = self.scale * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        else:
            d = self.scale * rng.paretovariate(self.alpha)
        return min(d, self.cap)

    def _sync(self) -> None:
        e = self.env
        self.task, self.seed, self.steps, self.done = e.task, e.seed, e.steps, e.done
        self.last_obs, self.last_info = e.last_obs, e.last_info

    # ----- the wrapped env, with the delay --------------------------------------------------------
    def reset(self, task_id: str, seed: int = 0) -> tuple[str, dict[str, Any]]:
        out = self.env.reset(task_id, seed)
        self._sync()
        return out

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        out = self.env.step(action)
        self._sync()
        d = self.delay(self.task.task_id if self.task else "", self.seed, self.steps)
        time.sleep(d)
        self.slept_s += d
        return out

    def tasks(self, split: str) -> list[Task]:
        return self.env.tasks(split)

    def get_task(self, task_id: str) -> Task:
        return self.env.get_task(task_id)

    def categories(self) -> list[str]:
        return self.env.categories()

    def prompt_spec(self) -> PromptSpec:
        return self.env.prompt_spec()

    def instruction(self) -> str:
        return self.env.instruction()

    def hidden_state(self) -> str:
        return self.env.hidden_state()

    def canonical_obs(self, obs: str) -> str:
        return self.env.canonical_obs(obs)

    def snapshot(self) -> Any:
        return self.env.snapshot()

    def restore(self, snap: Any) -> None:
        self.env.restore(snap)
        self._sync()

    def replay_deterministic(self, task_id: str) -> bool:
        return self.env.replay_deterministic(task_id)

    def reseed(self, seed: int) -> None:
        self.env.reseed(seed)

    def expert_action(self) -> str | None:
        return self.env.expert_action()

    def prepare(self, task_id: str) -> None:
        self.env.prepare(task_id)

    def close(self) -> None:
        self.env.close()
