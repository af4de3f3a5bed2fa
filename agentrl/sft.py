"""Supervised data and fitting: expert demonstrations rendered as the policy's own prompts, and the
SFT loop (also the warm start of RL runs and the fit stage of RFT)."""
from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

from agentrl.algos.losses import sft_loss
from agentrl.learner.batch import Sample, collate, turn_sample
from agentrl.learner.lr import lr_factor, restore_lr, set_lr
from agentrl.rollout.engine import first_prompt_ids
from envs import make
from envs.replay import expert_episode

if TYPE_CHECKING:
    from agentrl.trainer import Trainer


def answer_text(spec: Any, action: str) -> str:
    return f"<{spec.answer_tag}>{action}</{spec.answer_tag}>"


def expert_samples(trainer: "Trainer", n_episodes: int, split: str = "train") -> tuple[list[Sample], float]:
    """Turn samples from the env's expert on ``n_episodes`` tasks; returns samples and expert success.
    Full-history runs are trained turn by turn on windowed prompts (a documented simplification)."""
    cfg = trainer.rollout_config()
    env = make(trainer.cfg.env, **trainer.cfg.env_kwargs)
    tok = trainer.tokenizer
    eos = [tok.eos_token_id]
    ids = trainer.task_ids(split)
    rng = random.Random(trainer.cfg.trainer.seed + 17)
    samples, wins = [], 0
    try:
        for task_id in rng.sample(ids, min(n_episodes, len(ids))):
            trace, observations, infos = expert_episode(env, task_id, seed=rng.randrange(2**31))
            wins += bool(infos[-1].get("won"))
            spec, instruction = env.prompt_spec(), env.instruction()
            history: list[tuple[str, str]] = []
            for k, action in enumerate(trace.actions):
                admissible = infos[k].get("admissible_actions") if cfg.show_admissible else None
                prompt = first_prompt_ids(tok, cfg, spec, instruction, observations[k], history, k, admissible)
                target = tok(answer_text(spec, action), add_special_tokens=False)["input_ids"] + eos
                samples.append(turn_sample(prompt, target, [0.0] * len(target), 1.0, {"task": task_id}))
                history.append((observations[k], action))
    finally:
        env.close()
    return samples, wins / max(1, n_episodes)


def fit_sft(trainer: "Trainer", samples: list[Sample], epochs: int, batch_size: int, lr: float | None = None,
            schedule: str = "constant") -> dict[str, float]:
    """Plain NLL on the target tokens, shuffled mini-batches, ``epochs`` passes, lr per ``schedule``."""
    eng = trainer.engine
    base_lr = lr if lr is not None else eng.optimizer.param_groups[0]["lr"]
    saved = set_lr(eng, base_lr) if lr is not None or schedule != "constant" else None
    rng = random.Random(trainer.cfg.trainer.seed)

    def loss(mb: Any, out: Any) -> tuple[Any, dict[str, float]]:
        # a sample's advantages weigh its tokens (1.0 for plain SFT; LEAFE's rehearsal uses beta)
        return sft_loss(out["logp"] * mb.advantages, mb.loss_mask), {}

    losses = []
    n_batches = (len(samples) + batch_size - 1) // batch_size
    t0 = time.perf_counter()
    for epoch in range(epochs):
        order = list(range(len(samples)))
        rng.shuffle(order)
        for i in range(0, len(order), batch_size):
            if schedule != "constant":
                set_lr(eng, base_lr * lr_factor(epoch * n_batches + i // batch_size, epochs * n_batches, schedule))
            batch = collate([samples[j] for j in order[i:i + batch_size]], eng.pad_id)
            losses.append(eng.step(batch, loss)["loss"])
            b = i // batch_size + 1
            if b % 50 == 0 or b == n_batches:  # a long warm start should not be silent
                trainer.echo(f"sft pass {epoch + 1}/{epochs}: batch {b}/{n_batches}, loss {losses[-1]:.3f}, "
                             f"{time.perf_counter() - t0:.0f}s")
    if saved is not None:
        restore_lr(eng, saved)
    trainer.sync_weights()
    return {"sft_loss_first": losses[0] if losses else 0.0, "sft_loss_last": losses[-1] if losses else 0.0,
            "sft_samples": float(len(samples))}
