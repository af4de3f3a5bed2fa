"""The one interface every generation backend implements (embedded, our HTTP server, vLLM)."""
from __future__ import annotations

from typing import Any, Protocol

from agentrl.types import Completion, SamplingParams


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seeds: list[int] | None = None
                 ) -> list[Completion]:
        """One completion per prompt (token ids in, token ids + log-probs out). ``seeds``: one sampling
        stream per prompt, so a row samples the same tokens whatever else is in its batch (the
        embedded generator honours it exactly; servers use it where their API allows)."""

    def load_weights(self, source: Any) -> None:
        """New policy weights: a state dict (embedded) or an HF folder / LoRA adapter path (servers)."""


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Chat-template token ids (transformers returns a list or a BatchEncoding depending on version)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)
