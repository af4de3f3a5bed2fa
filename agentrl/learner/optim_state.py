"""The optimizer's per-parameter state between training phases."""
from __future__ import annotations

from typing import Any

import torch


def reset_optimizer_state(eng: Any) -> None:
    """Zero every parameter's optimizer state (Adam's moments and step count) in place, so the next step
    is a fresh optimizer's first. In place, not a new optimizer: DeepSpeed's ZeRO wrapper keeps references
    to its base optimizer's state tensors."""
    opt = getattr(eng.optimizer, "optimizer", eng.optimizer)  # ZeRO-3 wraps the engine's torch AdamW
    for state in opt.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                value.zero_()
            elif key == "step":
                state[key] = 0
