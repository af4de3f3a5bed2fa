"""Request scheduling for per-trajectory rollouts: one request per episode turn, batched by the scheduler.

Episodes submit one prompt at a time, whenever they are ready; a ``BatchingScheduler`` lane takes every
request waiting at that moment and makes one ``generate`` call of them (at most ``max_batch`` rows), so a
generator is never idle while a request waits and never waits for a row that is not ready. ``lanes`` is
how many calls may be in flight at once: 1 for the in-process generator (one model, one batch at a time),
one single-row lane per live episode for servers that batch concurrent requests themselves (vLLM's
continuous batching, ``agentrl serve``'s queue). A row's tokens depend on its own seed only (per-row
streams), so how rows are grouped into calls does not change what they sample.

A call costs about the same for a few rows as for many (decoding is bound by reading the weights), so the
in-process lane may ``linger``: when fewer rows wait than there are live episodes, it waits for more, at
most ``linger`` times its last call's duration. The wait is short next to a call, and the rows that land
meanwhile (env steps finishing) save a call of their own.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from agentrl.generation.batching import BatchQueue
from agentrl.types import Completion, SamplingParams


@dataclass
class _Request:
    prompt: list[int]
    seed: int | None
    choices: list[list[int]] | None
    future: Future


class BatchingScheduler:
    """Takes requests from any thread (``submit``) and answers each with a future of its ``Completion``.

    ``constrained``: pass ``choices`` to the generator (only then: a test double may not take them).
    Counters: ``calls`` (generate calls made), ``busy_s`` (wall time with at least one call in flight)."""

    def __init__(self, generator: Any, sampling: SamplingParams, max_batch: int = 0, lanes: int = 1,
                 constrained: bool = False, linger: float = 0.0):
        if lanes < 1:
            raise ValueError(f"scheduler lanes must be >= 1, got {lanes}")
        self.gen, self.sampling, self.max_batch, self.constrained = generator, sampling, max_batch, constrained
        self.linger, self._last_call_s = linger, 0.0
        self.live = 0  # episodes that may still submit (the caller keeps it current; 0: never linger)
        self.calls, self.busy_s, self.rows = 0, 0.0, 0
        self._q: BatchQueue[_Request] = BatchQueue()
        self._lock = threading.Lock()
        self._active, self._since, self._pending = 0, 0.0, 0
        self._threads = [threading.Thread(target=self._lane, daemon=True, name=f"agentrl-schedule-{k}")
                         for k in range(lanes)]
        for th in self._threads:
            th.start()

    def submit(self, prompt: list[int], seed: int | None = None, choices: list[list[int]] | None = None) -> Future:
        fut: Future = Future()
        with self._lock:
            self._pending += 1
        self._q.put(_Request(prompt, seed, choices, fut))
        return fut

    @property
    def pending(self) -> int:
        """Requests submitted and not yet answered."""
        return self._pending

    def _wait(self, batch: list[_Request], waited: float) -> float:
        """Linger for more rows while fewer wait than there are live episodes, at most ``linger`` times the
        last call's duration."""
        return self.linger * self._last_call_s - waited if len(batch) < self.live else 0.0

    def _fits(self, batch: list[_Request], _: object) -> bool:
        return not self.max_batch or len(batch) < self.max_batch

    def _lane(self) -> None:
        while (batch := self._q.take(self._wait, self._fits)) is not None:
            with self._lock:
                if self._active == 0:
                    self._since = time.perf_counter()
                self._active += 1
            t = time.perf_counter()
            try:
                outs = self._generate(batch)
                err = None
            except BaseException as e:  # every row of the call gets the error; the lane goes on
                outs, err = [], e
            self._last_call_s = time.perf_counter() - t
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self.busy_s += time.perf_counter() - self._since
                self.calls += 1
                self.rows += len(batch)
                self._pending -= len(batch)
            for k, r in enumerate(batch):
                if err is not None:
                    r.future.set_exception(err)
                else:
                    r.future.set_result(outs[k])

    def _generate(self, batch: list[_Request]) -> list[Completion]:
        seeds = [r.seed for r in batch]
        extra = {"choices": [r.choices for r in batch]} if self.constrained else {}
        outs = self.gen.generate([r.prompt for r in batch], self.sampling,
                                 seeds=None if any(s is None for s in seeds) else seeds, **extra)
        if len(outs) != len(batch):
            raise RuntimeError(f"generator returned {len(outs)} completions for {len(batch)} prompts")
        return outs

    def close(self) -> None:
        """Stop the lanes once the requests already queued are answered."""
        self._q.close()
        for th in self._threads:
            th.join()

    def __enter__(self) -> "BatchingScheduler":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def scheduler_for(generator: Any, sampling: SamplingParams, in_flight: int, constrained: bool = False,
                  linger: float = 0.5) -> BatchingScheduler:
    """The scheduling a generator wants: servers (``RemoteGenerator``, ``VLLMFleet``) get ``in_flight``
    concurrent single-row requests (the live episodes: each has at most one request out, so none waits on
    this side) and batch them themselves; anything else (the in-process generator) gets one lane that
    batches whatever is waiting."""
    from agentrl.generation.client import RemoteGenerator
    from agentrl.generation.vllm_fleet import VLLMFleet

    served = isinstance(generator, (RemoteGenerator, VLLMFleet))
    if served:
        return BatchingScheduler(generator, sampling, max_batch=1, lanes=max(1, in_flight), constrained=constrained)
    return BatchingScheduler(generator, sampling, lanes=1, constrained=constrained, linger=linger)
