"""Which tasks a step's fresh groups start from (``rollout.task_sampler``).

``uniform`` draws every group's task at random from the training split. ``learnability`` keeps a
frontier of start states whose last group had reward variance (solved sometimes, not always) and draws
``rollout.frontier_share`` of each round's groups from it, weighted by that variance; the rest are fresh.
Sampling for learnability is Rutherford et al. (2024, "No Regrets"); a replayed level buffer, Jiang et
al. (2021, prioritized level replay). A level whose group comes back all-fail or all-success leaves the
frontier: the group-relative gradient it would give is zero.

Every rank holds the same frontier: it is fed the gathered episodes and draws from the trainer's RNG,
which is the same stream on every rank.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable

from agentrl.algos.filters import MIN_STD, group_variance
from agentrl.registry import Registry
from agentrl.types import Episode

if TYPE_CHECKING:
    from agentrl.config import RolloutCfg
    from agentrl.run import Run

TASK_SAMPLERS = Registry("task sampler")
Key = tuple[str, int]  # (task id, reset seed): one start state


@TASK_SAMPLERS.register("uniform")
class UniformTasks:
    def __init__(self, cfg: "RolloutCfg"):
        pass

    def sample(self, trainer: "Run", n: int) -> list[Key]:
        return trainer.sample_tasks(n)

    def observe(self, episodes: list[Episode], reward: Callable[[Episode], float]) -> dict[str, float]:
        """Counts for the step's metrics (summed over its rounds)."""
        return {}

    def gauges(self) -> dict[str, float]:
        """The sampler's state at the end of a step, for the metrics."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@TASK_SAMPLERS.register("learnability")
class LearnabilityTasks(UniformTasks):
    def __init__(self, cfg: "RolloutCfg"):
        self.share = cfg.frontier_share
        self.size = cfg.frontier_size
        self.frontier: dict[Key, float] = {}  # oldest first; the value: the last group's reward variance
        self._step = -1
        self._drawn: set[Key] = set()  # frontier levels drawn this step (a later round draws others)
        self._replayed: set[Key] = set()  # the last round's frontier draws, for the stats

    def sample(self, trainer: "Run", n: int) -> list[Key]:
        if trainer.step != self._step:
            self._step, self._drawn = trainer.step, set()
        pool = {k: v for k, v in self.frontier.items() if k not in self._drawn}
        picks: list[Key] = []
        for _ in range(min(round(self.share * n), len(pool))):
            # one draw proportional to the variance, without replacement
            key = trainer.rng.choices(list(pool), weights=list(pool.values()))[0]
            picks.append(key)
            del pool[key]
        self._drawn.update(picks)
        self._replayed = set(picks)
        return picks + trainer.sample_tasks(n - len(picks))

    def observe(self, episodes: list[Episode], reward: Callable[[Episode], float]) -> dict[str, float]:
        """Each fresh-start group's outcome updates its level's place in the frontier (suffix replays
        start mid-episode and say nothing about the level from its start)."""
        groups: dict[str, list[Episode]] = defaultdict(list)
        for e in episodes:
            if e.start_index == 0 and not e.dropped:
                groups[e.group_id].append(e)
        out = dict(frontier_groups=0.0, frontier_informative_groups=0.0, fresh_groups=0.0,
                   fresh_informative_groups=0.0)
        for eps in groups.values():
            if len(eps) < 2:
                continue
            key = (eps[0].task_id, eps[0].seed)
            var = group_variance([reward(e) for e in eps])
            varies = math.sqrt(var) > MIN_STD  # the zero_variance filter's test: the group has a gradient
            kind = "frontier" if key in self._replayed else "fresh"
            out[f"{kind}_groups"] += 1
            out[f"{kind}_informative_groups"] += varies
            self.frontier.pop(key, None)
            if varies:
                self.frontier[key] = var  # re-inserted: the newest
        while len(self.frontier) > self.size:
            del self.frontier[next(iter(self.frontier))]
        return out

    def gauges(self) -> dict[str, float]:
        return dict(frontier_levels=float(len(self.frontier)))

    def state_dict(self) -> dict[str, Any]:
        return dict(frontier=list(self.frontier.items()))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.frontier = {tuple(k): v for k, v in state.get("frontier", [])}
