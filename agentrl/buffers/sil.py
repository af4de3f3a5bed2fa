"""SPEAR's self-imitation buffers (section 4.2, algorithm 1).

``SILBuffer`` (D, size N_D) holds trajectories whose group advantage was positive when they were
collected, and counts their training samples (turns at the turn level), as the paper's N_D = 2048 does: its
batches of 256 trajectories hold ~4K turn samples and fill D every two or three steps (appendix A.4);
``BaselineBuffer`` (D_R, FIFO of size N_DR) holds recent intra-group mean rewards. When D is
full, each stored trajectory's advantage is recalibrated against the current baseline,
A~ = R - P50(D_R) (eq. 2), only those with A^ > 0 and A~ > 0 are imitated (eq. 3), and D is emptied.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SILEntry:
    samples: list[Any]  # the trajectory's training samples (token ids, masks), as first built
    reward: float  # R
    adv: float  # A^, the group advantage when collected
    step: int = 0
    # the trajectory's group when it was rolled out (eq. 21 centres over the group): the mean reward of its
    # G rollouts and the mean log-prob of their generated tokens; None in entries from older checkpoints
    group_reward: float | None = None
    group_logp: float | None = None


@dataclass
class SILBuffer:
    capacity: int = 2048  # N_D, training samples
    entries: list[SILEntry] = field(default_factory=list)

    @property
    def size(self) -> int:
        """The samples held (an entry without samples counts as one)."""
        return sum(len(e.samples) or 1 for e in self.entries)

    @property
    def full(self) -> bool:
        return self.size >= self.capacity

    def add(self, entry: SILEntry) -> bool:
        """Only trajectories with a positive advantage enter (eq. 1), and only while D is not full."""
        if entry.adv <= 0 or self.full:
            return False
        self.entries.append(entry)
        return True

    def drain(self) -> list[SILEntry]:
        out, self.entries = self.entries, []
        return out


class BaselineBuffer:
    """FIFO of the latest N_DR intra-group mean rewards; P50 is the policy's baseline (eq. 2)."""

    def __init__(self, capacity: int = 10240, values: list[float] | None = None):
        self.values: deque[float] = deque(values or [], maxlen=capacity)

    def add(self, group_mean: float) -> None:
        self.values.append(float(group_mean))

    def p50(self) -> float:
        return float(statistics.median(self.values)) if self.values else 0.0

    def __len__(self) -> int:
        return len(self.values)


def dual_filter(entries: list[SILEntry], baseline: float) -> list[tuple[SILEntry, float]]:
    """(entry, A~) for the entries with A^ > 0 and A~ = R - P50 > 0 (eq. 2-3)."""
    out = []
    for e in entries:
        recal = e.reward - baseline
        if e.adv > 0 and recal > 0:
            out.append((e, recal))
    return out
