"""Log-probs of given tokens under a causal LM: what the learner recomputes for generated tokens."""
from __future__ import annotations

from typing import Any

import torch

from agentrl.types import effective_temperature


NEG = -1e9  # the logit of a token outside the allowed ids: exp(NEG - max) is 0 in float32, and entropies stay finite


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Constrained decoding's distribution: ``logits`` (..., V) with every id outside ``allowed`` (..., K),
    -1-padded, set to ``NEG``; a position whose row of ``allowed`` is all -1 keeps the whole vocabulary.
    The generator samples from it and the learner recomputes log-probs from it, so both read one policy."""
    if allowed is None:
        return logits
    constrained = (allowed >= 0).any(-1, keepdim=True)
    if not bool(constrained.any()):
        return logits
    # the padding scatters into one extra column, dropped after
    keep = torch.zeros((*logits.shape[:-1], logits.shape[-1] + 1), dtype=torch.bool, device=logits.device)
    keep.scatter_(-1, torch.where(allowed >= 0, allowed, logits.shape[-1]).to(logits.device), True)
    keep = keep[..., :-1] | ~constrained.to(logits.device)
    return logits.masked_fill(~keep, NEG)


def padded_ids(rows: list[list[int] | None]) -> torch.Tensor:
    """Id lists (None: unconstrained) as one (rows, K) tensor padded with -1, for ``mask_logits``."""
    out = torch.full((len(rows), max([len(r) for r in rows if r] or [1])), -1, dtype=torch.long)
    for j, r in enumerate(rows):
        if r:
            out[j, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def token_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """log p(input_ids[:, t] | input_ids[:, :t]) for t >= 1, shape (B, T-1), under softmax(logits / T).

    Sequences are right-padded; positions come from the mask so they match left-padded generation."""
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).logits[:, :-1].float()
    return torch.log_softmax(tempered(logits, temperature), dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature``; the logits themselves at a greedy temperature (0, or below
    ``agentrl.types.GREEDY_BELOW``), as the samplers read it, so the learner's log-probs are the sampled ones.
    At 1 the logits themselves too (x / 1 is x): no copy of a (positions x vocabulary) tensor, nor its backward."""
    t = effective_temperature(temperature)
    return logits / t if t > 0 and t != 1 else logits


def completion_logprobs(model: Any, prompt_ids: list[int], gen_ids: list[int], temperature: float = 1.0) -> list[float]:
    """Log-probs of ``gen_ids`` after ``prompt_ids`` (one sequence, no padding)."""
    ids = torch.tensor([prompt_ids + gen_ids])
    with torch.no_grad():
        lp = token_logprobs(model, ids, torch.ones_like(ids), temperature)
    return lp[0, len(prompt_ids) - 1:].tolist()
