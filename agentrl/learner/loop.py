"""The optimizer loop shared by RL updates, SFT and DPO: one engine step per batch, at an lr set for the loop
(and per step by a schedule), the engine's own lr put back however the loop ends. ``rl_update`` is the RL
step's use of it: PPO epochs over shuffled mini-batches, the non-finite policy, the decoupled correction of
stale samples and of the sampler/learner mismatch."""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable
from typing import Any

from agentrl.checkpoint import RunError
from agentrl.config import RecipeCfg
from agentrl.learner.batch import TokenBatch
from agentrl.learner.finite import params_finite
from agentrl.learner.lr import lr_state, restore_lr, set_lr
from agentrl.learner.protocol import LossFn


def optimizer_loop(eng: Any, batches: Iterable[TokenBatch], loss_fn: LossFn, lr: float | None = None,
                   lr_at: Callable[[int], float] | None = None,
                   after: Callable[[int, dict[str, float]], bool | None] | None = None,
                   **step_kw: Any) -> list[dict[str, float]]:
    """``eng.step(batch, loss_fn, **step_kw)`` for each batch; returns each step's stats. ``lr``: the loop runs
    at it; ``lr_at(k)``: step k's lr (a schedule); either way the engine's lr is restored at the end, also
    when a step raises. ``after(k, stats)`` returning False ends the loop early (SFT's pass selection)."""
    saved = set_lr(eng, lr) if lr is not None else (lr_state(eng) if lr_at is not None else None)
    out: list[dict[str, float]] = []
    try:
        for k, batch in enumerate(batches):
            if lr_at is not None:
                set_lr(eng, lr_at(k))
            out.append(eng.step(batch, loss_fn, **step_kw))
            if after is not None and after(k, out[-1]) is False:
                break
    finally:
        if saved is not None:
            restore_lr(eng, saved)
    return out


def nonfinite(s: dict[str, float], cfg: RecipeCfg, step: int, last: Any) -> bool:
    """Whether an optimizer step's loss or gradient norm is NaN or infinite (both are global under
    DeepSpeed, so every rank decides alike). ``trainer.nan_policy=stop`` ends the run here (``last``: the
    last checkpoint, named in the message)."""
    vals = {k: float(s[k]) for k in ("loss", "grad_norm") if k in s}
    if all(math.isfinite(v) for v in vals.values()):
        return False
    if cfg.trainer.nan_policy == "skip":
        return True
    shown = ", ".join(f"{k} {v}" for k, v in vals.items())
    raise RunError(f"step {step}: non-finite {shown} (trainer.nan_policy=stop): the run stops and this "
                   f"update is neither applied nor saved; the last checkpoint is {last}. "
                   "Lower optim.lr or check the rewards and resume with the same command, or set "
                   "trainer.nan_policy=skip to drop such updates and count them (nonfinite_skipped)")


def decouple(eng: Any, batch: TokenBatch, temperature: float, mode: str = "tis",
             cap: float = 2.0) -> dict[str, float]:
    """Samples drawn by another policy than the learner's (older weights under the overlap, or the same weights
    in a sampler with other kernels or dtype, ``algo.mismatch``): AReaL's decoupled PPO objective. The
    surrogate's ratio is taken against the proximal policy (these weights before the update, one extra
    forward pass) and each token's advantage is weighted by the behaviour importance weight pi_prox / pi_behav,
    truncated (tis) or masked per sequence (mis) (``behaviour_weights``); both are fixed over the update's
    epochs and mini-batches. ``old_logprob_gap``: the mean absolute sampler/learner difference."""
    from agentrl.algos.losses import behaviour_weights

    prox = eng.logprobs(batch, temperature)
    w, stats = behaviour_weights(prox, batch.old_logprobs, batch.loss_mask, cap, mode)
    stats["old_logprob_gap"] = _gap(prox, batch)
    batch.old_logprobs, batch.advantages = prox, batch.advantages * w
    return stats


def mismatch_mode(cfg: RecipeCfg) -> str:
    """``algo.mismatch`` resolved: "auto" corrects (tis) when vLLM samples (other kernels, often another
    dtype than the learner's) and not otherwise (the embedded generator and our server run the learner's
    weights through the same code)."""
    chosen = cfg.algo.mismatch
    if chosen == "auto":
        return "tis" if cfg.trainer.generator == "vllm" else "none"
    return chosen


def _gap(learner: Any, batch: TokenBatch) -> float:
    m = batch.loss_mask
    return float(((learner - batch.old_logprobs).abs() * m).sum() / m.sum().clamp(min=1))


def learner_logprobs(cfg: RecipeCfg) -> bool:
    """Whether an on-policy update takes its old log-probs from the learner (``algo.old_logprobs``)."""
    chosen = cfg.algo.old_logprobs
    return chosen == "learner" or (chosen == "auto" and cfg.rollout.mode == "async")


def recompute_old(eng: Any, batch: TokenBatch, temperature: float) -> dict[str, float]:
    """The batch's old log-probs from the learner (one no-grad pass), in place of the sampler's: the ratio's
    denominator then depends on the episodes only, not on which rows shared the generator's batches.
    ``old_logprob_gap``: the mean absolute sampler/learner difference over generated tokens."""
    learner = eng.logprobs(batch, temperature)
    gap = _gap(learner, batch)
    batch.old_logprobs = learner
    return dict(old_logprob_gap=gap)


def rl_update(eng: Any, batch: TokenBatch, loss_fn: LossFn, cfg: RecipeCfg, rng: random.Random, step: int,
              last: Any, need_values: bool = False, stale: bool = False) -> dict[str, float]:
    """RL step ``step``'s update on ``batch``: ``algo.ppo_epochs`` passes over its mini-batches (shuffled with
    ``rng``), the means of the applied steps' stats. No step when no token has a gradient (every advantage
    zero and no KL, entropy or value term: Adam's momentum would still move the weights). ``stale``: the
    samples were drawn by older weights; they, and any samples under ``algo.mismatch`` tis or mis, are
    corrected (``decouple``); otherwise the old log-probs may come from the learner (``recompute_old``,
    ``algo.old_logprobs``). ``last``: the last checkpoint, for error messages.
    ``time_learn_s`` counts from after the reference log-probs."""
    a, temp = cfg.algo, cfg.rollout.temperature
    if a.kl_in_loss:  # only the loss's KL term reads them
        batch.ref_logprobs = eng.ref_logprobs(batch, temp)
    t = time.perf_counter()
    if (not need_values and not batch.any_advantage()
            and not a.kl_in_loss and not a.entropy_coef):
        return dict(skipped_update=1.0, loss=0.0, grad_norm=0.0, time_learn_s=time.perf_counter() - t)
    mode = mismatch_mode(cfg)
    if stale or mode != "none":  # stale samples are corrected whatever algo.mismatch says (tis by default)
        decoupled = decouple(eng, batch, temp, "tis" if mode == "none" else mode, a.mismatch_cap)
    else:
        decoupled = recompute_old(eng, batch, temp) if learner_logprobs(cfg) else {}
    order = list(range(len(batch)))
    n_mb = -(-len(order) // a.mini_batch_samples) if a.mini_batch_samples > 0 else a.mini_batches
    n_mb = max(1, min(n_mb, len(order)))

    def mini_batches() -> Iterable[TokenBatch]:
        for _ in range(a.ppo_epochs):
            if n_mb > 1:
                rng.shuffle(order)
            for part in (order[i::n_mb] for i in range(n_mb)):
                yield batch if n_mb == 1 else batch.select(sorted(part))

    sums: dict[str, float] = {}
    counts = dict(applied=0, skipped=0)

    def tally(_: int, s: dict[str, float]) -> None:
        if nonfinite(s, cfg, step, last):  # not applied (StepGuard); skip policy: left out of the means
            counts["skipped"] += 1
            return
        for k, v in s.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        counts["applied"] += 1

    optimizer_loop(eng, mini_batches(), loss_fn, after=tally, temperature=temp, need_entropy=True,
                   need_values=need_values, weight_by="tokens" if a.agg == "token-mean" else "sequences")
    stats = {k: v / max(1, counts["applied"]) for k, v in sums.items()}  # means over the optimizer steps
    stats["optim_steps"] = float(counts["applied"])
    stats.update(decoupled)
    if cfg.trainer.nan_policy == "skip":
        stats["nonfinite_skipped"] = float(counts["skipped"])
    if not params_finite(eng):  # one max-abs reduction: finite gradients can still overflow a weight
        raise RunError(f"step {step}: the weights hold non-finite values after this update; the run stops "
                       f"without saving them (the last checkpoint is {last}). Lower optim.lr (or optim.grad_clip) "
                       "and resume with the same command")
    stats["time_learn_s"] = time.perf_counter() - t
    return stats
