"""Non-finite guards for the learner: an optimizer step whose gradients hold a NaN or an infinity is not
applied, and a cheap check that the weights are finite (one max-abs reduction over the parameters: this
rank's shards under ZeRO-3, agreed over the ranks)."""
from __future__ import annotations

from typing import Any

import torch


def _base_optimizer(engine: Any) -> Any:
    opt = getattr(engine, "optimizer", None)
    return getattr(opt, "optimizer", opt)  # ZeRO-3 wraps the engine's torch AdamW


class StepGuard:
    """A pre-step hook on the engine's torch optimizer: if any gradient it is about to apply is not finite,
    every gradient is dropped (``grad = None``), so the step leaves the weights and Adam's moments as they
    were. ``skipped`` counts the steps dropped."""

    def __init__(self, engine: Any):
        self.skipped = 0
        opt = _base_optimizer(engine)
        self._handle = opt.register_step_pre_hook(self._hook) if hasattr(opt, "register_step_pre_hook") else None

    def _hook(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        # the max-abs norm: NaN propagates through max, and it cannot overflow as a sum of squares can
        if grads and not bool(torch.isfinite(torch.nn.utils.get_total_norm(grads, float("inf")))):
            for g in opt.param_groups:
                for p in g["params"]:
                    p.grad = None
            self.skipped += 1

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()


@torch.no_grad()
def params_finite(engine: Any) -> bool:
    """Whether every weight the engine trains is finite. Collective under DeepSpeed (every rank checks its
    shards; all agree)."""
    ds = getattr(engine, "ds", None)
    if ds is not None:
        tensors = [p.ds_tensor if hasattr(p, "ds_tensor") else p for p in ds.module.parameters()]
    else:
        tensors = [p for p in engine.trainable_parameters()]
    tensors = [t.detach() for t in tensors if t.numel()]
    ok = not tensors or bool(torch.isfinite(torch.nn.utils.get_total_norm(tensors, float("inf"))))
    if ds is not None:
        import torch.distributed as dist

        if dist.is_initialized():
            flag = torch.tensor([0 if ok else 1], device=getattr(engine, "device", "cpu"))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            ok = not int(flag.item())
    return ok
