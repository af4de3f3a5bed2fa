"""Overlap of rollout and learning (``trainer.max_staleness`` > 0): a producer thread runs the recipe's
``collect`` for the next step while the learner trains on this one.

The producer hands ``collect`` the step's own rollout sampler (``RolloutSampler.for_step``): the run's
generator, env slots and tokenizer, but the step it collects for, a random stream of its own drawn from
(run seed, that step), its own rollout stats, and the version of the weights the generator holds, which
every turn records. So what it collects depends on the seed and the step only, never on the learner's
mini-batch shuffles or on timing. Nothing here imports the trainer or the recipes.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl import dist
from agentrl.rollout.sampler import RolloutSampler
from agentrl.types import Episode

# a recipe's ``collect``: the rollout side of the run (here a step's ``RolloutSampler``) -> (episodes, metrics)
CollectFn = Callable[[Any], tuple[list[Episode], dict[str, float]]]


@dataclass
class Collected:
    """One step's collect: its episodes, the recipe's collect metrics and the rollout stats (time, calls)."""

    step: int
    episodes: list[Episode]
    stats: dict[str, float]
    rollout_stats: dict[str, float] = field(default_factory=dict)


def collect(sampler: RolloutSampler, collect_fn: CollectFn, step: int, version: int) -> Collected:
    """Step ``step``'s episodes, drawn by the generator as it is (its weights are version ``version``)."""
    mine = sampler.for_step(step, version)
    episodes, stats = collect_fn(mine)
    return Collected(step, episodes, stats, dict(mine.stats))


class Producer:
    """At most one collect in flight, in a thread, and the collected step waiting to be trained on. Under
    several ranks the collect's gathers go to ``group`` (``dist.side_group``), apart from the learner's."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.pending: Collected | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def start(self, sampler: RolloutSampler, collect_fn: CollectFn, step: int, version: int) -> None:
        def work() -> None:
            try:
                with dist.collectives_on(self.group):
                    self.pending = collect(sampler, collect_fn, step, version)
            except BaseException as e:  # raised in the learner's thread by ``join``
                self._error = e

        self._thread = threading.Thread(target=work, name=f"agentrl-collect-{step}", daemon=True)
        self._thread.start()

    def join(self, raise_error: bool = True) -> None:
        """Wait for the collect in flight; its error, if any, is raised here (or dropped: the learner's own
        error is on its way)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None and raise_error:
            raise error

    def take(self, sampler: RolloutSampler, collect_fn: CollectFn, step: int) -> Collected:
        """Step ``step``'s collect: the one made ahead, or (the first step, a run trained on after it had
        finished) one made now with the current weights."""
        got, self.pending = self.pending, None
        if got is not None and got.step == step:
            return got
        return collect(sampler, collect_fn, step, step)
