"""The one interface every generation backend implements (embedded, our HTTP server, vLLM)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from agentrl.types import Completion, SamplingParams

if TYPE_CHECKING:
    from agentrl.learner.protocol import LearnerEngine


@runtime_checkable
class Generator(Protocol):
    """``EmbeddedGenerator`` (in this process), ``RemoteGenerator`` (``agentrl serve``) and ``VLLMFleet``
    (vLLM servers) implement it; the trainer calls nothing else on a generator, except on one that ``stages``:
    there ``stage(engine)`` (collective) copies the engine's weights to host memory and ``load_weights(copy)``
    later puts that older version in (``trainer.max_staleness`` > 1, ``agentrl.rollout.overlap``)."""

    stages: bool  # whether an older weights version can be handed over later as a host copy

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seeds: list[int] | None = None,
                 choices: list[list[list[int]] | None] | None = None) -> list[Completion]:
        """One completion per prompt (token ids in, token ids + log-probs out). ``seeds``: one sampling
        stream per prompt, so a row samples the same tokens whatever else is in its batch (the
        embedded generator honours it exactly; servers use it where their API allows). ``choices``: per
        prompt, the token-id sequences its completion must be one of (constrained decoding; None: free);
        ``Completion.allowed`` then lists the ids each token was drawn among."""

    def receive(self, engine: "LearnerEngine", staging: Path) -> dict[str, float]:
        """Sample from ``engine``'s current weights from now on. Called by every rank after each update
        (collective: ZeRO-3 gathers); ``staging`` is a folder the generator may write weights to. Returns
        sync metrics (time, server check) for the step's log."""

    def release(self) -> bool:
        """Free the accelerator memory generation holds while the learner trains (colocated vLLM servers
        sleep); True when it did, and then the next ``receive`` gives it back. Collective."""

    def close(self) -> None: ...


class TakesWeightsMidCollect(Protocol):
    """A generator that takes new weights while a collect runs (``trainer.inflight_updates``; the embedded
    generator and ``VLLMFleet``): ``offer`` a staged copy of version ``version`` (the learner's thread; the
    fleet's is collective), ``set_version`` when the caller loaded one itself; every token it draws records
    its version in ``Completion.versions``."""

    version: int  # the weights version a generation starting now is drawn by
    inflight: bool  # record per-token versions and take offers mid-collect
    inflight_loads: int  # versions loaded while a collect may run, so far

    def offer(self, version: int, weights: Any) -> None: ...

    def set_version(self, version: int) -> None: ...


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Chat-template token ids (transformers returns a list or a BatchEncoding depending on version)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)
