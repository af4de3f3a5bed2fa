"""What the pieces below the trainer may ask of a run: the ``Run`` protocol.

Recipes, SFT, DPO and the task samplers are written against this protocol, not against ``Trainer``, so
they never import the trainer (imports point down) and a test may hand them a small stand-in. The
trainer (``agentrl.trainer.Trainer``) is the one implementation of ``Run``. ``RolloutSide`` is the part a
recipe's ``collect`` needs (rollouts, task draws, the step and its random stream): the trainer, or under
the overlap (``trainer.max_staleness``) a step's ``agentrl.rollout.sampler.RolloutSampler``. Under several
ranks every method marked collective is called by every rank with the same arguments.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from agentrl.config import RecipeCfg
    from agentrl.learner.batch import Sample
    from agentrl.learner.protocol import LearnerEngine, LossFn
    from agentrl.rollout.episode import RolloutConfig, Start
    from agentrl.types import Completion, Episode, SamplingParams


class RolloutSide(Protocol):
    """The rollout side of a run: what a recipe's ``collect`` (starts, task draws, rollouts) may use."""

    cfg: RecipeCfg
    """The run's resolved configuration (read-only by convention)."""
    rng: random.Random
    """The run's random stream: the same on every rank, so decisions drawn from it agree; checkpointed."""
    tokenizer: Any
    """The policy's tokenizer (Hugging Face)."""
    is_main: bool
    """True on rank 0, which alone writes files shared by the ranks."""

    @property
    def step(self) -> int:
        """Training steps done so far (0 during the warm start): the step being collected for."""
        ...

    def rollout(self, starts: list[Start], temperature: float | None = None, max_turns: int | None = None
                ) -> list[Episode]:
        """Collective: one episode per start, in order, on every rank."""
        ...

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        """Collective: plain completions of token-id prompts (no env), in order, on every rank."""
        ...

    def task_ids(self, split: str) -> list[str]:
        """The env's task ids of a split, in the env's order."""
        ...

    def sample_tasks(self, n: int, split: str | None = None) -> list[tuple[str, int]]:
        """``n`` (task id, reset seed) drawn from ``rng`` (from ``rollout.split`` unless given)."""
        ...

    def rollout_config(self, temperature: float | None = None, max_turns: int | None = None) -> RolloutConfig:
        """How rollouts are driven and prompted (``rollout.*``), with a fresh sampling seed from ``rng``."""
        ...

    def echo(self, text: str) -> None:
        """A progress line for the user (rank 0 only)."""
        ...


class Run(RolloutSide, Protocol):
    """One training run as the recipes see it."""

    step: int
    """Training steps done so far (0 during the warm start)."""
    engine: LearnerEngine
    """The learner (weights, optimizer); SFT, DPO and KL terms call it directly."""
    out_dir: Path
    """The run folder (checkpoints, metrics, the warm start's copy)."""
    model_dir: Path
    """The model folder the run started from (``sft.warm_start``'s when given)."""

    def update(self, samples: list[Sample], loss_fn: LossFn, need_values: bool = False) -> dict[str, float]:
        """Collective: train on the samples with ``loss_fn`` (``algo``'s epochs and mini-batches), then hand
        the new weights to the generator; returns the update's metrics."""
        ...

    def sync_weights(self) -> None:
        """Collective: the generator samples from the learner's current weights from now on (after an
        update made directly on ``engine``)."""
        ...

    def evaluate(self, n_tasks: int | None = None, samples: int | None = None, split: str | None = None,
                 ks: tuple[int, ...] | None = None, temperature: float | None = None) -> dict[str, float]:
        """Collective: success, score and pass@k (``eval/...`` metrics) on a split's first tasks."""
        ...

    def values(self, samples: list[Sample]) -> list[float]:
        """The critic's value at the last prompt token of each sample (PPO)."""
        ...

    def token_values(self, samples: list[Sample]) -> list[list[float]]:
        """The critic's value before every generated token of each sample (token-level GAE)."""
        ...

    def diagnostics(self, episodes: list[Episode], recipe: Any) -> dict[str, float]:
        """Collective: a step's episode statistics, timings and env-worker counts for the metrics."""
        ...
