"""Direct preference optimization on (prompt, chosen, rejected) action pairs (RRO, IPR).

The reference policy is the policy at the start of the fit (the SFT policy for the first one); its
sequence log-probs are computed once. Each optimizer step sees whole pairs (chosen and rejected rows of
a pair are never split across micro-batches or ranks), on either engine.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from agentrl.algos.losses import dpo_loss
from agentrl.learner.batch import Sample, collate, turn_sample
from agentrl.learner.lr import restore_lr, set_lr

if TYPE_CHECKING:
    from agentrl.trainer import Trainer


@dataclass
class PreferencePair:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    meta: dict = field(default_factory=dict)


def pair_rows(pairs: list[PreferencePair]) -> list[Sample]:
    """Rows [chosen_0, rejected_0, chosen_1, ...]; only the action tokens are targets."""
    rows = []
    for p in pairs:
        rows.append(turn_sample(p.prompt_ids, p.chosen_ids, [0.0] * len(p.chosen_ids), 0.0))
        rows.append(turn_sample(p.prompt_ids, p.rejected_ids, [0.0] * len(p.rejected_ids), 0.0))
    return rows


def with_reference(engine: Any, rows: list[Sample], temperature: float = 1.0) -> list[Sample]:
    """The rows with the current policy's per-token log-probs as their reference (``ref_logprobs``)."""
    lp = engine.logprobs(collate(rows, engine.pad_id), temperature)
    for b, s in enumerate(rows):
        row = [0.0] + lp[b, :len(s.ids) - 1].tolist()
        s.ref_logprobs = [v if m else 0.0 for v, m in zip(row, s.loss_mask)]
    return rows


def dpo_loss_fn(beta: float) -> Any:
    """The engine loss of a micro-batch of whole pairs (rows chosen, rejected, chosen, ...): DPO on
    sequence log-probs against the reference stored in the rows."""

    def fn(mb: Any, out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        seq = (out["logp"] * mb.loss_mask).sum(-1)
        ref = (mb.ref_logprobs * mb.loss_mask).sum(-1)
        return dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta)

    return fn


def fit_dpo(trainer: "Trainer", pairs: list[PreferencePair], epochs: int, batch_size: int, lr: float,
            beta: float) -> dict[str, float]:
    """``epochs`` passes over the pairs, one optimizer step per ``batch_size`` pairs (both engines:
    ``row_block=2`` keeps a pair's two rows in one micro-batch and on one rank)."""
    eng = trainer.engine
    if not pairs:
        return dict(dpo_pairs=0.0)
    rows = with_reference(eng, pair_rows(pairs))
    saved = set_lr(eng, lr)
    rng = random.Random(trainer.cfg.trainer.seed)
    loss_fn = dpo_loss_fn(beta)
    stats: list[dict[str, float]] = []
    try:
        for _ in range(epochs):
            order = list(range(len(pairs)))
            rng.shuffle(order)
            for i in range(0, len(order), batch_size):
                batch = collate([rows[2 * j + k] for j in order[i:i + batch_size] for k in (0, 1)], eng.pad_id)
                stats.append(eng.step(batch, loss_fn, 1.0, weight_by="sequences", row_block=2))
    finally:
        restore_lr(eng, saved)
    trainer.sync_weights()
    last = stats[-1]
    return dict(dpo_pairs=float(len(pairs)), dpo_loss_first=stats[0]["loss"], dpo_loss_last=last["loss"],
                dpo_accuracy_last=last["accuracy"], dpo_margin_last=last["reward_margin"])
