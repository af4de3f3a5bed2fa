"""CRPS's suffix length k (sections 3.5): where a replay of a successful trace hands over to the policy.

``t0 = max(0, T - k)`` (eq. 8): small k starts near the goal (easy), k = T from the initial state.
``initial_k`` is eq. 9; ``KController`` keeps an EMA of the replay group's success (eq. 10-11) and moves k
by ``delta`` to hold it inside the band [rho_l, rho_u] (eq. 12), one controller per buffer entry.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def initial_k(acc: float, T: int, beta_min: float, beta_max: float, k_min: int, k_max: int) -> int:
    """k0 = clip(floor((beta_min + (beta_max - beta_min) acc) T), k_min, k_max): harder tasks (low
    group accuracy) start from shorter suffixes."""
    raw = math.floor((beta_min + (beta_max - beta_min) * acc) * T + 1e-9)  # 1e-9: 0.5 * 4 must floor to 2
    return max(k_min, min(k_max, raw))


def suffix_start(T: int, k: int) -> int:
    """t0 = max(0, T - k) (eq. 8)."""
    return max(0, T - k)


@dataclass
class KController:
    k: int
    k_min: int = 1
    k_max: int = 10
    lam: float = 0.9  # EMA weight of the newest replay group (paper appendix E: 0.9)
    rho_low: float = 0.2
    rho_high: float = 0.8
    delta: int = 2
    # The paper leaves the EMA's start open; the band's midpoint makes the first update act on the
    # first observation (with lam = 0.9 it dominates) without a spurious move.
    rho_hat: float | None = None

    def update(self, acc_replay: float) -> int:
        """One replay group's success rate in, the next k out (eq. 11-12)."""
        prev = 0.5 * (self.rho_low + self.rho_high) if self.rho_hat is None else self.rho_hat
        self.rho_hat = (1.0 - self.lam) * prev + self.lam * acc_replay
        if self.rho_hat > self.rho_high:
            self.k = min(self.k + self.delta, self.k_max)
        elif self.rho_hat < self.rho_low:
            self.k = max(self.k - self.delta, self.k_min)
        return self.k

    def state_dict(self) -> dict:
        return asdict(self)
