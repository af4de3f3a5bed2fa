"""Direct preference optimization on (prompt, chosen, rejected) action pairs (RRO, IPR), and on pairs of
whole multi-turn trajectories (IPR's outcome-level pairs), whose log-prob is the sum over their turns.

The reference policy is the policy at the start of the fit (the SFT policy for the first one); its
sequence log-probs are computed once. Each optimizer step sees whole pairs (the rows of a pair are never
split across micro-batches or ranks), on either engine.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from agentrl.algos.losses import dpo_loss
from agentrl.learner.batch import Sample, collate, turn_sample
from agentrl.learner.loop import optimizer_loop

if TYPE_CHECKING:
    from agentrl.run import Run


@dataclass
class PreferencePair:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    meta: dict = field(default_factory=dict)

    def sides(self) -> tuple[list[tuple[list[int], list[int]]], list[tuple[list[int], list[int]]]]:
        return [(self.prompt_ids, self.chosen_ids)], [(self.prompt_ids, self.rejected_ids)]


@dataclass
class TrajectoryPair:
    """A preferred and a dispreferred trajectory, each as its turns' (prompt ids, response ids)."""

    chosen: list[tuple[list[int], list[int]]]
    rejected: list[tuple[list[int], list[int]]]
    meta: dict = field(default_factory=dict)

    def sides(self) -> tuple[list[tuple[list[int], list[int]]], list[tuple[list[int], list[int]]]]:
        return self.chosen, self.rejected


def pair_rows(pairs: list[PreferencePair | TrajectoryPair]) -> tuple[list[Sample], int]:
    """Rows of every pair, chosen turns then rejected turns, each side padded with empty rows to ``width``
    (the most turns a side has), so a pair is a block of 2 x width rows; only response tokens are targets."""
    width = max(len(side) for p in pairs for side in p.sides())
    rows = []
    for p in pairs:
        for side in p.sides():
            rows += [turn_sample(prompt, resp, [0.0] * len(resp), 0.0) for prompt, resp in side]
            rows += [Sample([0, 0], [0, 0], [0.0, 0.0], [0.0, 0.0]) for _ in range(width - len(side))]
    return rows, width


def with_reference(engine: Any, rows: list[Sample], temperature: float = 1.0) -> list[Sample]:
    """The rows with the current policy's per-token log-probs as their reference (``ref_logprobs``)."""
    lp = engine.logprobs(collate(rows, engine.pad_id), temperature)
    for b, s in enumerate(rows):
        row = [0.0] + lp[b, :len(s.ids) - 1].tolist()
        s.ref_logprobs = [v if m else 0.0 for v, m in zip(row, s.loss_mask)]
    return rows


def dpo_loss_fn(beta: float, width: int = 1) -> Any:
    """The engine loss of a micro-batch of whole pairs (blocks of ``width`` chosen rows, then ``width``
    rejected rows): DPO on each side's log-prob summed over its rows, against the reference in the rows."""

    def fn(mb: Any, out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        seq = (out["logp"] * mb.loss_mask).sum(-1).view(-1, 2, width).sum(-1)
        ref = (mb.ref_logprobs * mb.loss_mask).sum(-1).view(-1, 2, width).sum(-1)
        return dpo_loss(seq[:, 0], seq[:, 1], ref[:, 0], ref[:, 1], beta)

    return fn


def fit_dpo(trainer: "Run", pairs: list[PreferencePair | TrajectoryPair], epochs: int, batch_size: int,
            lr: float, beta: float, prefix: str = "dpo") -> dict[str, float]:
    """``epochs`` passes over the pairs, one optimizer step per ``batch_size`` pairs (both engines:
    ``row_block`` keeps a pair's rows in one micro-batch and on one rank). Metrics are named ``prefix_*``."""
    eng = trainer.engine
    if not pairs:
        return {f"{prefix}_pairs": 0.0}
    rows, width = pair_rows(pairs)
    rows = with_reference(eng, rows)
    block = 2 * width
    rng = random.Random(trainer.cfg.trainer.seed)
    loss_fn = dpo_loss_fn(beta, width)

    def batches() -> Any:
        for _ in range(epochs):
            order = list(range(len(pairs)))
            rng.shuffle(order)
            for i in range(0, len(order), batch_size):
                yield collate([rows[block * j + k] for j in order[i:i + batch_size] for k in range(block)], eng.pad_id)

    stats = optimizer_loop(eng, batches(), loss_fn, lr=lr, temperature=1.0, weight_by="sequences", row_block=block)
    trainer.sync_weights()
    last = stats[-1]
    return {f"{prefix}_pairs": float(len(pairs)), f"{prefix}_loss_first": stats[0]["loss"],
            f"{prefix}_loss_last": last["loss"], f"{prefix}_accuracy_last": last["accuracy"],
            f"{prefix}_margin_last": last["reward_margin"]}
