"""Direct preference optimization on (prompt, chosen, rejected) action pairs (RRO, IPR).

The reference policy is the policy at the start of the fit (the SFT policy for the first one); its
sequence log-probs are computed once. Each optimizer step sees whole pairs (chosen and rejected rows of
a pair are never split across micro-batches), so DPO runs on the torch engine only.
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


def sequence_logprobs(engine: Any, rows: list[Sample], temperature: float = 1.0) -> torch.Tensor:
    batch = collate(rows, engine.pad_id)
    with torch.no_grad():
        lp = engine.logprobs(batch, temperature)
    return (lp * batch.loss_mask).sum(-1)


def fit_dpo(trainer: "Trainer", pairs: list[PreferencePair], epochs: int, batch_size: int, lr: float,
            beta: float) -> dict[str, float]:
    eng = trainer.engine
    if not hasattr(eng, "_clip_and_step"):
        raise NotImplementedError("DPO runs on the torch engine (trainer.engine=torch)")
    if not pairs:
        return dict(dpo_pairs=0.0)
    rows = pair_rows(pairs)
    ref = sequence_logprobs(eng, rows)
    ref_c, ref_r = ref[0::2], ref[1::2]
    saved = set_lr(eng, lr)
    rng = random.Random(trainer.cfg.trainer.seed)
    stats: list[dict[str, float]] = []
    try:
        for _ in range(epochs):
            order = list(range(len(pairs)))
            rng.shuffle(order)
            for i in range(0, len(order), batch_size):
                idx = order[i:i + batch_size]
                batch = collate([rows[2 * j + k] for j in idx for k in (0, 1)], eng.pad_id)
                eng.model.train()
                eng.optimizer.zero_grad(set_to_none=True)
                out = eng.forward(batch, 1.0)
                seq = (out["logp"] * batch.loss_mask).sum(-1)
                t = torch.tensor(idx)
                loss, s = dpo_loss(seq[0::2], seq[1::2], ref_c[t], ref_r[t], beta)
                eng._backward(loss)
                s.update(loss=float(loss.detach()), grad_norm=eng._clip_and_step())
                stats.append(s)
    finally:
        restore_lr(eng, saved)
    trainer.sync_weights()
    last = stats[-1]
    return dict(dpo_pairs=float(len(pairs)), dpo_loss_first=stats[0]["loss"], dpo_loss_last=last["loss"],
                dpo_accuracy_last=last["accuracy"], dpo_margin_last=last["reward_margin"])
