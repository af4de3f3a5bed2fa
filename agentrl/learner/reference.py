"""The frozen reference policy that KL terms measure against: a copy of some weights held in memory,
evaluated without gradient. Both engines use it (DeepSpeed: one full copy per rank, as its embedded
generator does); with LoRA the torch engine instead disables its adapters and needs no copy."""
from __future__ import annotations

from pathlib import Path

import torch

from agentrl.learner.batch import TokenBatch
from agentrl.learner.engine import batched_forward, forward_batch


class FrozenReference:
    def __init__(self, folder: str | Path, dtype: str, device: str, token_budget: int):
        from agentrl.learner.models import load_model

        self.folder, self.device, self.token_budget = Path(folder), device, token_budget
        self.model = load_model(folder, dtype, device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch, temperature: float = 1.0) -> torch.Tensor:
        def fwd(mb: TokenBatch, t: float, need_values: bool = False) -> dict[str, torch.Tensor]:
            return forward_batch(self.model, None, mb, t, targets_only=True)

        return batched_forward(fwd, batch, self.token_budget, temperature, False, self.device)[0]
