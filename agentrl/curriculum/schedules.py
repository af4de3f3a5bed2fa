"""SPEAR's curriculum schedules (appendix A.6): a cosine warm-up of the self-imitation weight gamma
(eq. 13) and a cosine decay of the intrinsic tool-call reward weight mu (eq. 14)."""
from __future__ import annotations

import math


def cosine_warmup(step: int, warmup_steps: int) -> float:
    """gamma = (1 - cos(pi t / T_warmup)) / 2 for t <= T_warmup, else 1 (0 -> 1)."""
    if warmup_steps <= 0 or step > warmup_steps:
        return 1.0
    return 0.5 * (1.0 - math.cos(math.pi * step / warmup_steps))


def cosine_decay(step: int, decay_steps: int) -> float:
    """mu = (cos(pi t / T_decay) + 1) / 2 for t <= T_decay, else 0 (1 -> 0)."""
    if decay_steps <= 0 or step > decay_steps:
        return 0.0
    return 0.5 * (math.cos(math.pi * step / decay_steps) + 1.0)
