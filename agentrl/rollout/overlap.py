"""Overlap of rollout and learning (``trainer.max_staleness`` = N > 0): a producer thread runs the recipe's
``collect`` for the steps ahead while the learner trains on this one.

The schedule is fixed, so seeded runs repeat and N ranks match one: step t's collect is drawn with the
weights of version v(t) = max(0, t - N) (version k: the weights after k updates). At the start of step s
the learner releases the collect of step s + N; the producer runs the released collects in step order,
each once its version is in the generator or staged (a copy the learner made after that update), and
queues them; the learner takes step s's and waits only when it is not there yet. At most N collected
steps wait in the queue; version k serves the one collect k + N, so N staged copies exist while the producer
keeps up, N + 1 for the moment when an update ends before the collect that needs the oldest has started.

Each collect gets the step's own rollout sampler (``RolloutSampler.for_step``): the run's generator, env
slots and tokenizer, but the step it collects for, a random stream drawn from (run seed, that step), its
own rollout stats, and the version of the weights the generator holds, which every turn records. So what
it collects depends on the seed, the step and the version only, never on timing. Nothing here imports the
trainer or the recipes.

In-flight weight updates (``inflight``: the generator, ``trainer.inflight_updates``): a released collect starts
at once, and each staged version is offered to the generator as soon as it exists, which loads it in the
middle of a collect (the in-process generator before its next forward pass; vLLM servers at once, their
running requests aborted and continued, ``agentrl.generation.inflight``); every token records the version
that drew it.
The bound holds as before: step t's collect is released at the start of step t - N, when version t - N is
already offered, so no token is older than N versions and nothing is dropped or cut. What is collected then
depends on when updates land, so such runs do not repeat token for token.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl import dist
from agentrl.rollout.sampler import RolloutSampler
from agentrl.types import Episode, Turn

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


def inflight_metrics(turns: list[Turn], step: int, loads: int) -> dict[str, float]:
    """Step ``step``'s in-flight figures: the weight loads during its collects (``loads``), the share of turns
    drawn by more than one version, and the staleness of each generated token (not only of each turn's oldest)."""
    tokens = [step - v for t in turns for v in (t.gen_versions or [t.policy_version] * len(t.gen_ids))]
    mixed = sum(len(set(t.gen_versions)) > 1 for t in turns)
    return dict(inflight_loads=float(loads), inflight_mixed_turns=mixed / max(1, len(turns)),
                staleness_token_mean=sum(tokens) / max(1, len(tokens)))


class Producer:
    """The collects of the steps ahead, in one thread, on the schedule above (``ahead`` = N). ``load`` puts a
    staged copy into the generator (None: the learner syncs the generator itself, between collects, and says
    which version it holds with ``set_loaded``). Under several ranks the collects' gathers go to ``group``
    (``dist.side_group``), apart from the learner's."""

    def __init__(self, sampler: RolloutSampler, collect_fn: CollectFn, ahead: int,
                 load: Callable[[Any], None] | None = None, group: Any = None, inflight: Any = None) -> None:
        self.sampler, self.collect_fn, self.ahead, self._load, self.group = sampler, collect_fn, ahead, load, group
        # in-flight updates: the generator that takes offered versions mid-collect (``offer``, ``set_version``,
        # ``version``: agentrl.generation.embedded.EmbeddedGenerator)
        self.inflight = inflight
        self.queue: dict[int, Collected] = {}  # collected steps not yet trained on, by step
        self.next = 0  # the next step to collect
        self.released = 0  # collects of steps below this may start
        self.loaded = 0  # the weights version the generator holds
        self.staged: dict[int, Any] = {}  # version -> its copy, until the collect that needs it starts
        self.wait_weights_s = 0.0  # the producer's time waiting for a released collect's weights (read and reset)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._busy = False  # a collect in flight
        self._stop = False

    def version(self, step: int) -> int:
        """The weights version step ``step`` is collected with."""
        return max(0, step - self.ahead)

    # ----- the learner's side --------------------------------------------------------------------
    def restore(self, step: int, queued: list[Collected], loaded: int) -> None:
        """A resumed run at ``step``: the checkpoint's queued steps, the generator holding version ``loaded``."""
        with self._cond:
            self.queue = {c.step: c for c in queued if c.step >= step}
            self.next = max([step, *(s + 1 for s in self.queue)])
            self.released, self.loaded, self.staged = self.next, loaded, {}
            if self.inflight is not None:
                self.inflight.set_version(loaded)

    def release(self, upto: int) -> None:
        """Collects up to step ``upto`` may start (the producer thread starts with the first release)."""
        with self._cond:
            self.released = max(self.released, upto + 1)
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="agentrl-collect", daemon=True)
            self._thread.start()

    @property
    def stages(self) -> bool:
        """Whether the learner hands its weights on as staged copies (else it syncs the generator itself)."""
        return self._load is not None

    def stage(self, version: int, weights: Any) -> None:
        """Version ``version``'s copy, for the collect that needs it."""
        with self._cond:
            self.staged[version] = weights
            if self.inflight is not None:  # the newest kept for evaluations
                self._drop_staged_before(version)
            self._cond.notify_all()
        if self.inflight is not None:  # to the generator now, mid-collect (servers: collective, so outside the lock)
            self.inflight.offer(version, weights)

    def take(self, step: int) -> tuple[Collected, float]:
        """Step ``step``'s collect and the seconds the learner waited for it (its error raised here)."""
        t = time.perf_counter()
        with self._cond:
            while step not in self.queue:
                self._raise()
                if self.next > step and not self._busy:
                    raise RuntimeError(f"step {step}'s collect is neither queued nor coming (next: {self.next})")
                self._cond.wait()
            return self.queue.pop(step), time.perf_counter() - t

    def drain(self) -> None:
        """Wait until every released collect is queued, so the producer is idle (a checkpoint stores the
        queue; an evaluation uses the generator). The point is the same on every rank: the releases are."""
        with self._cond:
            while self._busy or (self.next < self.released and self._thread is not None):
                self._raise()
                self._cond.wait()
            self._raise()

    def set_loaded(self, version: int) -> None:
        """The learner put version ``version`` into the generator (while the producer is drained)."""
        with self._cond:
            self.loaded = version
            if self.inflight is not None:
                self.inflight.set_version(version)

    def load_staged(self, version: int) -> bool:
        """The generator to version ``version`` from its staged copy (kept for its collect), while the
        producer is drained; False when there is none."""
        with self._cond:
            weights = self.staged.get(version)
        if weights is None or self._load is None:
            return False
        self._load(weights)
        self.set_loaded(version)
        return True

    def close(self) -> None:
        """Stop the thread: at once when idle; a collect in flight is left to end on its own (a daemon)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            busy = self._busy
        if self._thread is not None and not busy:
            self._thread.join(timeout=10.0)

    def _drop_staged_before(self, version: int) -> None:
        for old in [k for k in self.staged if k < version]:
            del self.staged[old]

    def _raise(self) -> None:
        if self._error is not None:  # kept: the thread has ended, every later wait must fail too
            raise self._error

    # ----- the producer's thread -----------------------------------------------------------------
    def _ready(self) -> bool:
        if self.next >= self.released:
            return False
        if self.inflight is not None:  # the weights come to the generator as they are staged
            return True
        v = self.version(self.next)
        # an older version than the generator's that is not staged is gone (a run resumed with a larger N):
        # the collect takes the generator's, and its turns record that
        return v <= self.loaded or v in self.staged

    def _run(self) -> None:
        try:
            with dist.collectives_on(self.group):
                while True:
                    with self._cond:
                        while not self._stop and not self._ready():
                            released = self.next < self.released  # waiting for weights, not for the learner
                            t = time.perf_counter()
                            self._cond.wait()
                            if released:
                                self.wait_weights_s += time.perf_counter() - t
                        if self._stop:
                            return
                        step, v = self.next, self.version(self.next)
                        weights = None
                        if self.inflight is None:
                            weights = self.staged.pop(v, None)
                            self._drop_staged_before(v)  # never needed again
                        self._busy = True
                    if weights is not None and v != self.loaded:
                        assert self._load is not None
                        self._load(weights)
                        self.loaded = v
                    got = collect(self.sampler, self.collect_fn, step, self.loaded)
                    with self._cond:
                        if self.inflight is not None:
                            self.loaded = self.inflight.version
                        self.queue[step] = got
                        self.next, self._busy = step + 1, False
                        self._cond.notify_all()
        except BaseException as e:  # raised in the learner's thread by ``take`` or ``drain``
            with self._cond:
                self._error, self._busy, self._stop = e, False, True
                self._cond.notify_all()
