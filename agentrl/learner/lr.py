"""Learning-rate control shared by the SFT, DPO and RL loops: set an engine's lr for the coming steps,
put it back, and the decay schedules."""
from __future__ import annotations

import math
from typing import Any


def set_lr(eng: Any, lr: float) -> Any:
    """Run the optimizer at ``lr`` (times the warm-up factor while warming up): the LR scheduler recomputes
    every group's lr from its ``base_lrs`` at each step, so those are what must change (setting the
    groups' lr alone lasts one step).
    Returns what ``restore_lr`` needs."""
    saved = lr_state(eng)
    sched = getattr(eng, "scheduler", None)
    if sched is not None:
        sched.base_lrs = [lr] * len(sched.base_lrs)
    for i, g in enumerate(eng.optimizer.param_groups):
        g["lr"] = lr * warmup_factor(sched, i)
    return saved


def warmup_factor(sched: Any, group: int) -> float:
    """The engine's warm-up multiplier for its next step (``optim.warmup_steps``): an lr set between
    steps must keep it, or the step right after ``set_lr`` runs at the full lr mid-warm-up."""
    lambdas = getattr(sched, "lr_lambdas", None)
    return float(lambdas[min(group, len(lambdas) - 1)](sched.last_epoch)) if lambdas else 1.0


def lr_state(eng: Any) -> Any:
    """The scheduler's base lrs and the groups' lrs now, for ``restore_lr`` (loading an optimizer state
    brings back the lr it was saved with)."""
    sched = getattr(eng, "scheduler", None)
    return (list(sched.base_lrs) if sched is not None else None, [g["lr"] for g in eng.optimizer.param_groups])


def restore_lr(eng: Any, saved: Any) -> None:
    base, current = saved
    if base is not None:
        eng.scheduler.base_lrs = base
    for g, v in zip(eng.optimizer.param_groups, current):
        g["lr"] = v


def lr_factor(step: int, total: int, schedule: str) -> float:
    """Multiplier of the base lr at step ``step`` of ``total`` (1 at the first step; "linear" and
    "cosine" reach 0 at ``total``)."""
    frac = step / max(1, total)
    if schedule == "linear":
        return 1.0 - frac
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * frac))
    return 1.0
