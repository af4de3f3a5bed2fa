"""The learner's side of the overlap (``trainer.max_staleness`` = N > 0); the producer's side is
``agentrl.rollout.overlap.Producer``.

Per step: release the collect N steps ahead and take this step's (``take``); after learning, hand the new
weights on (``hand_on``): staged as a host copy for the collect that needs them (and, with in-flight updates,
offered to the generator at once), or, for servers that are pushed the learner's own weights (vLLM at N = 1),
pushed once the collect in flight is done. An update during a step defers its push to the step's end
(``defer``); before an evaluation, a checkpoint or a resume the producer is idle and the generator current
(``make_current``, ``sync``). The trainer calls these; nothing here imports the trainer or the recipes.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from agentrl.rollout.overlap import Collected, CollectFn, Producer, inflight_metrics
from agentrl.rollout.sampler import RolloutSampler


class CollectAhead:
    def __init__(self, trainer_cfg: Any, generator: Any, sampler: RolloutSampler, collect_fn: CollectFn,
                 group: Any = None) -> None:
        t = trainer_cfg
        self.generator = generator
        # each update's weights are staged and loaded in the producer's thread before the collect that needs
        # them: the in-process generator always, vLLM servers at N > 1 or with in-flight updates; at N = 1 a
        # server is pushed the learner's own weights, checked, once the collect in flight is done
        staged = generator.stages and (t.generator == "embedded" or t.max_staleness > 1 or t.inflight_updates)
        inflight = None
        if t.inflight_updates:  # the generator takes offers mid-collect (``TakesWeightsMidCollect``)
            inflight = generator
            inflight.inflight = True
        self.producer = Producer(sampler, collect_fn, t.max_staleness, generator.load_weights if staged else None,
                                 group, inflight)
        self.due = False  # an update during a step: its weights go out after the step
        self.in_step = False
        self._loads_logged = 0  # the generator's in-flight loads logged so far

    @property
    def queue(self) -> dict[int, Collected]:
        return self.producer.queue

    def take(self, step: int) -> tuple[Collected, dict[str, float]]:
        """Step ``step``'s collect (released N steps ago, or now and waited for) and its queue figures."""
        p = self.producer
        p.release(step + p.ahead)
        got, waited = p.take(step)
        return got, dict(overlap_queue_depth=float(len(p.queue)), time_wait_collect_s=waited)

    def hand_on(self, step: int, engine: Any, out_dir: Path, turns: list[Any]) -> dict[str, float]:
        """After step ``step``'s learning, its weights (version ``step + 1``) for the collect that needs them;
        returns the step's overlap figures (and a deferred server sync's own: time, check)."""
        p, due, self.due, version = self.producer, self.due, False, step + 1
        t = time.perf_counter()
        out: dict[str, float] = {}
        if p.stages:  # collect version + N needs it, and is not released yet: always staged (a step that
            # skipped its update stages the same weights again); collective under DeepSpeed, so here
            p.stage(version, self.generator.stage(engine))
            out["time_stage_s"] = time.perf_counter() - t
        else:
            p.drain()
            if due:
                out.update(self.generator.receive(engine, out_dir))
            p.set_loaded(version)
        out["time_wait_weights_s"], p.wait_weights_s = p.wait_weights_s, 0.0
        if p.inflight is not None:
            out.update(inflight_metrics(turns, step, p.inflight.inflight_loads - self._loads_logged))
            self._loads_logged = p.inflight.inflight_loads
        return out

    def defer(self) -> bool:
        """An update inside a step: True when its push waits for ``hand_on`` (the producer is sampling)."""
        if self.in_step:
            self.due = True
        return self.in_step

    def sync(self, engine: Any, out_dir: Path, version: int) -> dict[str, float]:
        """Outside a step: the producer finishes its released collects, then the generator takes the
        learner's weights (version ``version``)."""
        self.producer.drain()
        got = self.generator.receive(engine, out_dir)
        self.producer.set_loaded(version)
        return got

    def make_current(self, version: int) -> bool:
        """Before an evaluation: the producer idle, and the generator on version ``version`` from its staged
        copy when there is one; False when the caller must sync it."""
        p = self.producer
        p.drain()
        return p.loaded == version or p.load_staged(version)

    def drain(self) -> None:
        self.producer.drain()

    def restore(self, step: int, queued: list[Collected]) -> None:
        self.producer.restore(step, queued, loaded=step)

    def close(self) -> None:
        self.producer.close()
