"""KL as a reward penalty: each episode's reward loses coef x its KL to the reference policy (the k1 sum
over the tokens the policy generated, log pi_rollout - log pi_ref), with the coefficient fixed or adapted
toward a target KL (Ziegler et al., 2019, as TRL and verl implement it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class KLController:
    coef: float  # the current coefficient
    target: float | None = None  # adaptive when set: the KL per episode the coefficient steers toward
    horizon: int = 10_000  # episodes over which a 20% error changes the coefficient by ~e^0.2

    def update(self, kl: float, n_episodes: int) -> None:
        """After a batch of ``n_episodes`` whose mean KL was ``kl``: coef *= 1 + clip(kl / target - 1,
        -0.2, 0.2) * n / horizon. A fixed controller (no target) keeps its coefficient."""
        if self.target is None or self.target <= 0:
            return
        error = min(0.2, max(-0.2, kl / self.target - 1.0))
        self.coef *= 1.0 + error * n_episodes / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return dict(coef=self.coef)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef = float(state.get("coef", self.coef))
