"""Log-probs of given tokens under a causal LM: what the learner recomputes for generated tokens."""
from __future__ import annotations

from typing import Any

import torch


def token_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """log p(input_ids[:, t] | input_ids[:, :t]) for t >= 1, shape (B, T-1), under softmax(logits / T).

    Sequences are right-padded; positions come from the mask so they match left-padded generation."""
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]


def completion_logprobs(model: Any, prompt_ids: list[int], gen_ids: list[int], temperature: float = 1.0) -> list[float]:
    """Log-probs of ``gen_ids`` after ``prompt_ids`` (one sequence, no padding)."""
    ids = torch.tensor([prompt_ids + gen_ids])
    with torch.no_grad():
        lp = token_logprobs(model, ids, torch.ones_like(ids), temperature)
    return lp[0, len(prompt_ids) - 1:].tolist()
