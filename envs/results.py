"""What a batched env call answers for one slot."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class StepResult:
    obs: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    @property
    def dropped(self) -> bool:
        return bool(self.info.get("dropped"))
