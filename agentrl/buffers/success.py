"""CRPS's success buffer (section 3.4): task instances with a successful trace that are not yet easy.

An entry is b = (x, z, T, {(o_t, a_t)}) (eq. 5): the instruction, the env's init id (task id + seed),
the trace of env actions with the fingerprint after each (for a verified replay-prefix restore), and
the turn-level observations and actions (the prompt's history window when replay hands over at turn
t0). T counts turns, so a replay always hands over at a turn boundary. Insertion is gated by the
group's accuracy (eq. 7); each entry carries its own k controller (eq. 11-12) and replay statistics;
an entry whose replays keep succeeding from the initial state is removed as mastered.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from agentrl.curriculum.suffix_k import KController
from agentrl.types import Episode
from agentrl.envs.replay import Trace


@dataclass
class SuccessEntry:
    task_id: str
    seed: int
    instruction: str
    trace: Trace
    observations: list[str]  # observation before turn j
    actions: list[str]  # turn j's actions as the history shows them
    boundaries: list[int]  # env steps taken after turn j (trace index where turn j + 1 starts)
    acc: float  # group accuracy when inserted
    ctrl: KController
    inserted_at: int = 0
    replays: int = 0
    replay_wins: int = 0
    mastery_streak: int = 0

    @property
    def key(self) -> str:
        return f"{self.task_id}:{self.seed}"

    @property
    def T(self) -> int:
        return len(self.actions)

    def handover(self, k: int) -> tuple[int, int]:
        """(t0 in turns, t0 in env steps) for suffix length k (eq. 8)."""
        t0 = max(0, self.T - k)
        return t0, (self.boundaries[t0 - 1] if t0 else 0)

    def history(self, t0: int) -> list[tuple[str, str]]:
        return list(zip(self.observations[:t0], self.actions[:t0]))

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("task_id", "seed", "instruction", "observations", "actions", "boundaries",
                                           "acc", "inserted_at", "replays", "replay_wins", "mastery_streak")}
        d.update(trace=self.trace.to_dict(), ctrl=self.ctrl.state_dict())
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SuccessEntry":
        d = dict(d)
        d["trace"] = Trace(**d["trace"])
        d["ctrl"] = KController(**d["ctrl"])
        return cls(**d)


def trace_of(ep: Episode) -> Trace:
    fps = [ep.initial_fingerprint] + [fp for t in ep.turns for fp in t.fingerprints]
    return Trace(ep.env, ep.task_id, ep.seed, ep.env_actions, fps)


WHEN_FULL = ("evict_oldest", "refuse")  # what a full buffer does with a new entry (SuccessBuffer.insert)


@dataclass
class SuccessBuffer:
    capacity: int = 256
    alpha_max: float = 0.75  # eq. 7: only tasks the group did not find easy
    # The paper leaves a full buffer open. "evict_oldest": FIFO; "refuse": new instances wait until an
    # entry is mastered, so a small buffer is a working set each entry of which is replayed many times
    when_full: str = "evict_oldest"
    entries: dict[str, SuccessEntry] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: dict(inserted=0, rejected_easy=0, duplicate=0,
                                                                evicted_full=0, evicted_mastered=0,
                                                                rejected_full=0))

    def __len__(self) -> int:
        return len(self.entries)

    def offer(self, ep: Episode, acc: float, ctrl: KController, step: int = 0) -> bool:
        """Insert a successful fresh episode when its group accuracy acc(x) <= alpha_max (eq. 7)."""
        if not ep.won or ep.start_index or ep.dropped or not ep.turns:
            return False
        if acc > self.alpha_max:
            self.counts["rejected_easy"] += 1
            return False
        observations, actions, boundaries, n, obs = [], [], [], 0, ep.initial_observation
        for t in ep.turns:  # turns that sent no action (bad format) are not part of the trace or history
            if t.actions:
                observations.append(obs)
                actions.append(t.action_text)
                n += len(t.actions)
                boundaries.append(n)
            obs = t.observation
        return self.insert(SuccessEntry(ep.task_id, ep.seed, ep.instruction, trace_of(ep), observations, actions,
                                        boundaries, acc, ctrl, inserted_at=step))

    def offer_expert(self, trace: Trace, observations: list[str], instruction: str, ctrl: KController,
                     step: int = 0) -> bool:
        """Insert the env expert's successful episode (one action a turn) of an instance no rollout has
        solved: its suffix replays give the policy successes to learn from where fresh groups are all-zero."""
        T = len(trace.actions)
        if not T:
            return False
        entry = SuccessEntry(trace.task_id, trace.seed, instruction, trace, observations[:T], list(trace.actions),
                             list(range(1, T + 1)), 0.0, ctrl, inserted_at=step)
        if self.insert(entry):
            self.counts["expert"] = self.counts.get("expert", 0) + 1
            return True
        return False

    @property
    def refusing(self) -> bool:
        """Full, and turning new entries away."""
        return self.when_full == "refuse" and len(self.entries) >= self.capacity

    def insert(self, entry: SuccessEntry) -> bool:
        """Add an entry unless its instance is buffered already; a full buffer drops its oldest first
        (``when_full="evict_oldest"``) or turns the entry away (``"refuse"``)."""
        if entry.key in self.entries:  # keep the entry and its controller; one success per instance is enough
            self.counts["duplicate"] += 1
            return False
        if self.refusing:
            self.counts["rejected_full"] += 1
            return False
        if len(self.entries) >= self.capacity:  # FIFO: the oldest entry makes room
            oldest = min(self.entries.values(), key=lambda e: e.inserted_at)
            del self.entries[oldest.key]
            self.counts["evicted_full"] += 1
        self.entries[entry.key] = entry
        self.counts["inserted"] += 1
        return True

    def sample(self, rng: random.Random) -> SuccessEntry:
        return self.entries[rng.choice(sorted(self.entries))]

    def record_replay(self, key: str, acc_replay: float, full_horizon: bool, mastery_acc: float,
                      mastery_patience: int, update_k: bool = True) -> None:
        """Feed one replay group's success rate to the entry's controller; remove the entry once replay
        from the initial state has succeeded >= mastery_acc for mastery_patience groups in a row."""
        e = self.entries.get(key)
        if e is None:
            return
        e.replays += 1
        e.replay_wins += acc_replay > 0
        if update_k:
            e.ctrl.update(acc_replay)
        e.mastery_streak = e.mastery_streak + 1 if full_horizon and acc_replay >= mastery_acc else 0
        if mastery_patience and e.mastery_streak >= mastery_patience:
            del self.entries[key]
            self.counts["evicted_mastered"] += 1

    def state_dict(self) -> dict[str, Any]:
        return dict(entries=[e.to_dict() for e in self.entries.values()], counts=dict(self.counts))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.entries = {e.key: e for e in map(SuccessEntry.from_dict, state["entries"])}
        self.counts = {**self.counts, **state["counts"]}  # a checkpoint from before a counter existed lacks it
