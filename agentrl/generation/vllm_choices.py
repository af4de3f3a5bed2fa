"""Constrained decoding inside vLLM (``vllm serve --logits-processors
agentrl.generation.vllm_choices:ChoiceLogits``, which ``VLLMServer`` passes).

A request carries its answers as token-id sequences in ``vllm_xargs={"agentrl_choices": JSON}`` (what
``RemoteGenerator`` sends for ``generate(..., choices=...)``); each token is then drawn among the ids that
continue an answer, exactly the set the embedded generator's ``ChoiceTrie`` allows and the learner masks
to, so the policy vLLM samples from is the one the learner trains. vLLM's own structured outputs
(``choice``) constrain text, not token ids: they admit every tokenization of an answer, a wider set than
the learner's. Requests without the key decode freely. This module imports nothing from agentrl but
itself: it runs in vLLM's interpreter (its own virtualenv on CPU).
"""
from __future__ import annotations

import json
from typing import Any

import torch

XARG = "agentrl_choices"
MAX_CHOICES = 1024


def parse_choices(raw: Any) -> list[list[int]]:
    """The request's answers from their JSON string; a ValueError (HTTP 400 from vLLM) names what is wrong."""
    try:
        choices = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as e:
        raise ValueError(f"vllm_xargs.{XARG} is not JSON: {e}") from None
    if not isinstance(choices, list) or not 0 < len(choices) <= MAX_CHOICES or not all(
            isinstance(c, list) and c and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in c)
            for c in choices):
        raise ValueError(f"vllm_xargs.{XARG} must be a JSON list of 1-{MAX_CHOICES} non-empty token-id lists")
    return choices


class ChoiceMask:
    """One request's answers as a table from the ids generated so far to the ids that may come next. After
    a whole answer only the end-of-sequence ids may follow (our answers end with their stop string, so
    vLLM stops there first)."""

    def __init__(self, choices: list[list[int]], end_ids: list[int]):
        nxt: dict[tuple[int, ...], set[int]] = {}
        for c in choices:
            for k in range(len(c)):
                nxt.setdefault(tuple(c[:k]), set()).add(c[k])
        for c in choices:
            nxt.setdefault(tuple(c), set()).update(end_ids)
        self.next = {k: sorted(v) for k, v in nxt.items() if v}
        self._ids: dict[tuple[tuple[int, ...], Any], torch.Tensor] = {}

    def allowed(self, output_ids: list[int]) -> list[int] | None:
        """None off the table (nothing left to constrain: the client reports a completion off its answers)."""
        return self.next.get(tuple(output_ids))

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        key = tuple(output_ids)
        allowed = self.next.get(key)
        if allowed is None:
            return logits
        ids = self._ids.get((key, logits.device))
        if ids is None:
            ids = self._ids[(key, logits.device)] = torch.tensor(allowed, dtype=torch.long, device=logits.device)
        ids = ids[ids < logits.shape[-1]]
        out = torch.full_like(logits, float("-inf"))
        out[ids] = logits[ids]
        return out


def _end_ids(vllm_config: Any) -> list[int]:
    eos = getattr(getattr(getattr(vllm_config, "model_config", None), "hf_config", None), "eos_token_id", None)
    return [] if eos is None else [int(x) for x in (eos if isinstance(eos, (list, tuple)) else [eos])]


try:  # vLLM is only importable in its own interpreter; the table above is tested without it
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor
except ImportError:  # pragma: no cover - depends on where this module is imported
    AdapterLogitsProcessor = None

if AdapterLogitsProcessor is not None:
    class ChoiceLogits(AdapterLogitsProcessor):  # type: ignore[misc,valid-type]
        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool):
            super().__init__(vllm_config, device, is_pin_memory)
            self.end_ids = _end_ids(vllm_config)

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            raw = (getattr(sampling_params, "extra_args", None) or {}).get(XARG)
            if raw is not None:
                parse_choices(raw)

        def is_argmax_invariant(self) -> bool:
            return False  # it changes which token greedy decoding picks

        def new_req_logits_processor(self, params: Any) -> ChoiceMask | None:
            raw = (getattr(params, "extra_args", None) or {}).get(XARG)
            return None if raw is None else ChoiceMask(parse_choices(raw), self.end_ids)
