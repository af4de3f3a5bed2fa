"""Overlap of rollout and learning (``trainer.max_staleness`` > 0): a producer thread runs the recipe's
``collect`` for the next step while the learner trains on this one.

The producer sees the run through a ``CollectView``: the run's parts (generator, env slots, tokenizer,
config), but the step it collects for, a random stream of its own drawn from (run seed, that step), its own
rollout stats, and the version of the weights the generator holds, which every turn records. So what it
collects depends on the seed and the step only, never on the learner's mini-batch shuffles or on timing.
Nothing here imports the trainer or the recipes (the run is typed ``Any``: ``agentrl.run.Run`` sits above
this layer); the view binds the run's own methods to itself.
"""
from __future__ import annotations

import inspect
import random
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl import dist
from agentrl.seeds import mix_seed
from agentrl.types import Episode

# a recipe's ``collect``: the run (here a ``CollectView`` of it) -> (episodes, collect metrics)
CollectFn = Callable[[Any], tuple[list[Episode], dict[str, float]]]

COLLECT_STREAM = 0x0C0113C7  # tags the producer's streams apart from every other use of the run seed


@dataclass
class Collected:
    """One step's collect: its episodes, the recipe's collect metrics and the rollout stats (time, calls)."""

    step: int
    episodes: list[Episode]
    stats: dict[str, float]
    rollout_stats: dict[str, float] = field(default_factory=dict)


class CollectView:
    """The run as one step's collect sees it (see the module doc). Methods of the run's class run with this
    view as ``self``, so ``rollout`` and ``sample_tasks`` draw from the view's stream and count into its stats."""

    def __init__(self, run: Any, step: int, version: int):
        self._run = run
        self.step = step
        self.policy_version = version
        self.rng = random.Random(mix_seed(run.cfg.trainer.seed, COLLECT_STREAM, step))
        self._rollout_stats: dict[str, float] = {}

    def __getattr__(self, name: str) -> Any:
        attr = inspect.getattr_static(type(self._run), name, None)
        if inspect.isfunction(attr):
            return types.MethodType(attr, self)
        return getattr(self._run, name)


def collect(run: Any, collect_fn: CollectFn, step: int, version: int) -> Collected:
    """Step ``step``'s episodes, drawn by the generator as it is (its weights are version ``version``)."""
    view = CollectView(run, step, version)
    episodes, stats = collect_fn(view)
    return Collected(step, episodes, stats, dict(view._rollout_stats))


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

    def start(self, run: Any, collect_fn: CollectFn, step: int, version: int) -> None:
        def work() -> None:
            try:
                with dist.collectives_on(self.group):
                    self.pending = collect(run, collect_fn, step, version)
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

    def take(self, run: Any, collect_fn: CollectFn, step: int) -> Collected:
        """Step ``step``'s collect: the one made ahead, or (the first step, a run trained on after it had
        finished) one made now with the current weights."""
        got, self.pending = self.pending, None
        if got is not None and got.step == step:
            return got
        return collect(run, collect_fn, step, step)
