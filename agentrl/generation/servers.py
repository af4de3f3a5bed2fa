"""Several generation servers as one ``Generator``: spread requests, survive a dead server, sync all.

Requests: a call's prompts are cut into units of identical prompts (a group's G rollouts share their
prompt: kept on one server, so its prefix cache serves all of them) and each unit goes to the live
server with the fewest prompts in flight. A transient error (connection refused, reset, HTTP 5xx) is
retried with exponential backoff; a server that still fails is reported by name, marked dead, and its
prompts are sent to the others (a request the server itself rejects, HTTP 4xx, is raised at once: no
server would take it), so the step continues (it fails cleanly, naming every server, only
when none is left). Weights: every sync goes to every live server; a server whose sync failed holds
a mix of old and new weights and is never sampled from again in this run.
"""
from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

import torch

from agentrl.generation.client import GenerationServerError
from agentrl.types import Completion, SamplingParams


class ServerPool:
    def __init__(self, clients: dict[str, Any], retries: int = 3, backoff_s: float = 0.5):
        if not clients:
            raise GenerationServerError("no generation servers")
        self.clients, self.retries, self.backoff_s = dict(clients), retries, backoff_s
        self.dead: dict[str, str] = {}  # name -> why (died, or missed a weight sync)
        self.in_flight = {n: 0 for n in clients}
        self._lock = threading.Lock()

    @property
    def live(self) -> list[str]:
        return [n for n in self.clients if n not in self.dead]

    def _mark_dead(self, name: str, why: str) -> None:
        with self._lock:
            if name not in self.dead:
                self.dead[name] = why
                print(f"warning: generation server {name} removed: {why}", file=sys.stderr, flush=True)

    def _call(self, name: str, prompts: list[list[int]], sampling: SamplingParams, seeds: list[int] | None,
              choices: list[list[list[int]] | None] | None) -> list[Completion]:
        extra = {} if choices is None else {"choices": choices}  # only constrained calls pass them
        delay = self.backoff_s
        for _ in range(self.retries):
            try:
                return self.clients[name].generate(prompts, sampling, seeds=seeds, **extra)
            except GenerationServerError as e:
                if e.refused or e.refused_connection:  # rejected, or no listener through request()'s own retries
                    raise
                time.sleep(delay)  # transient: a restart, a full queue, a dropped connection
                delay *= 2
        return self.clients[name].generate(prompts, sampling, seeds=seeds, **extra)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seeds: list[int] | None = None,
                 choices: list[list[list[int]] | None] | None = None) -> list[Completion]:
        units: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(prompts):
            units.setdefault(tuple(p), []).append(i)
        out: list[Completion | None] = [None] * len(prompts)
        todo = list(units.values())
        while todo:
            live = self.live
            if not live:
                raise GenerationServerError("every generation server is gone: " +
                                            "; ".join(f"{n}: {w}" for n, w in self.dead.items()))
            plan: dict[str, list[int]] = {n: [] for n in live}
            load = {n: self.in_flight[n] for n in live}
            for unit in sorted(todo, key=len, reverse=True):
                n = min(live, key=lambda k: (load[k], live.index(k)))
                plan[n] += unit
                load[n] += len(unit)
            todo = []

            def run(name: str, idx: list[int]) -> tuple[str, list[int], Any]:
                with self._lock:
                    self.in_flight[name] += len(idx)
                try:
                    res = self._call(name, [prompts[i] for i in idx], sampling,
                                     None if seeds is None else [seeds[i] for i in idx],
                                     None if choices is None else [choices[i] for i in idx])
                    return name, idx, res
                except GenerationServerError as e:
                    return name, idx, e
                finally:
                    with self._lock:
                        self.in_flight[name] -= len(idx)

            jobs = [(n, idx) for n, idx in plan.items() if idx]
            with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
                results = list(pool.map(lambda j: run(*j), jobs))
            for name, _idx, res in results:
                if isinstance(res, GenerationServerError) and res.refused:
                    raise GenerationServerError(f"generation server {name} refused the request: {res}", res.status)
            for name, idx, res in results:
                if isinstance(res, Exception):
                    self._mark_dead(name, f"died mid-step ({res})")
                    todo.append(idx)  # its prompts go to the servers left
                else:
                    for i, c in zip(idx, res):
                        out[i] = c
        return out  # type: ignore[return-value]

    def push_weights(self, sync: Any, weights: Iterable[tuple[str, torch.Tensor | None]],
                     timeout_s: float = 300.0) -> None:
        """Every live server gets ``weights`` through ``sync`` (each within ``timeout_s``); those that fail
        are never sampled again."""
        failed = sync.push({n: self.clients[n] for n in self.live}, weights, timeout_s)
        for name, why in failed.items():
            self._mark_dead(name, f"missed a weight sync ({why})")

    def mark(self, dead: dict[str, str]) -> None:
        """Take another rank's view of which servers are gone (rank 0 syncs; every rank samples)."""
        for name, why in dead.items():
            self._mark_dead(name, why)
