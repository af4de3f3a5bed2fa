"""The env-slots protocol: N envs stepped together, what the rollout engine and the trainer call.

``EnvPool`` (one process per env, crash recovery) and ``InProcessEnvs`` (no isolation) implement it.
Requests are keyed by slot index; each answer is a ``StepResult``.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from agentrl.envs.replay import Trace
from agentrl.envs.results import StepResult


@runtime_checkable
class EnvSlots(Protocol):
    stats: dict[str, int]  # restarts, replayed, dropped, timeouts, crashes
    last_error: str  # why a worker was last restarted ("" if never)

    def __len__(self) -> int: ...

    def reset(self, requests: dict[int, tuple[str, int]]) -> dict[int, StepResult]:
        """Slot -> (task id, seed): a fresh episode in each listed slot."""

    def restore(self, requests: dict[int, tuple[Trace, int, int | None]]) -> dict[int, StepResult]:
        """Slot -> (trace, t, reseed): the state after the trace's first t actions (native snapshot or
        replay-prefix, fingerprint-checked); ``reseed`` re-seeds the env's randomness from there."""

    def step(self, actions: dict[int, str]) -> dict[int, StepResult]:
        """Slot -> action text: one step in each listed slot."""

    def call(self, slot: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Any other env method on one slot's env (``tasks``, ``prompt_spec``, ``expert_action``, ...)."""

    def close(self) -> None: ...
