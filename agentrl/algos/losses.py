"""Losses over token tensors (B, T) with a loss mask that is 1 only on policy-generated tokens.

Policy: PPO/GRPO clipped surrogate with decoupled clip range (eps_low, eps_high: DAPO's clip-higher),
dual clip (constant C for negative advantages), four aggregation modes, KL penalty (k1/k3), entropy
bonus, Clip-Cov token masking. Also the clipped value loss, SFT (NLL on action tokens) and DPO.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from agentrl.registry import Registry

LOSSES = Registry("loss")
LOG_RATIO_CLAMP = 20.0  # |log pi/pi_old| beyond this is clipped anyway (e^20 ~ 5e8)
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(x: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              norm_len: int | None = None) -> torch.Tensor:
    """Reduce per-token values to a scalar.

    token-mean: sum over all tokens / number of tokens (every token weighs the same);
    seq-mean-token-mean: mean per sequence, then mean over sequences;
    seq-mean-token-sum: sum per sequence, then mean over sequences;
    seq-mean-token-sum-norm: sum per sequence / a constant (``norm_len``, default T), mean over sequences
    (Dr. GRPO: no length normalization bias)."""
    mask = mask.to(x.dtype)
    x = torch.where(mask > 0, x, torch.zeros_like(x))  # a NaN or inf at a masked position must not leak
    if mode == "token-mean":
        return (x * mask).sum() / mask.sum().clamp(min=1)
    per_seq = (x * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / float(norm_len or x.shape[-1])
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss aggregation '{mode}'; allowed: {', '.join(AGG_MODES)}")
    has_tokens = (mask.sum(-1) > 0).to(x.dtype)
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def clip_cov_mask(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip_ratio: float = 2e-4,
                  bounds: tuple[float, float] = (1.0, 5.0), generator: torch.Generator | None = None) -> torch.Tensor:
    """Clip-Cov (Cui et al., 2025): detach a random ``clip_ratio`` fraction of the tokens whose centred
    covariance (logp - mean logp) * (A - mean A) lies in ``bounds``. Returns the mask of tokens kept in
    the gradient (1 = keep)."""
    valid = mask.bool()
    n = int(valid.sum())
    keep = mask.clone().to(logp.dtype)
    if n == 0:
        return keep
    lp, a = logp.detach()[valid], adv.detach()[valid]
    cov = (lp - lp.mean()) * (a - a.mean())
    candidates = torch.nonzero((cov > bounds[0]) & (cov < bounds[1]))[:, 0]
    k = min(len(candidates), max(1, int(clip_ratio * n))) if len(candidates) else 0
    if k:
        chosen = candidates[torch.randperm(len(candidates), generator=generator)[:k]]
        flat = keep[valid]
        flat[chosen] = 0.0
        keep[valid] = flat
    return keep


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None,
                agg: str = "token-mean", norm_len: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), with dual clip
    max(., C A)-bounded loss for A < 0 when ``dual_clip`` (C > 1) is set."""
    # clamped before exp: a stale sample's log-ratio of +-100 would give inf (and inf * 0 = NaN)
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    loss = -torch.min(surr1, surr2)
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip constant must be > 1, got {dual_clip}")
        loss = torch.where(adv < 0, torch.min(loss, -dual_clip * adv), loss)
    m = mask.to(logp.dtype)
    with torch.no_grad():
        clipped = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
        stats = dict(clip_frac=float(aggregate(clipped.to(m.dtype), m)),
                     approx_kl=float(aggregate((ratio - 1) - log_ratio, m)),
                     ratio_mean=float(aggregate(ratio, m)))
    return aggregate(loss, mask, agg, norm_len), stats


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from samples of pi: k1 = log(pi/ref); k3 = r - 1 - log r with
    r = ref/pi (Schulman's low-variance, always >= 0)."""
    if kind == "k1":
        return logp - ref_logp
    if kind == "k3":
        log_r = ref_logp - logp
        return torch.exp(log_r) - 1 - log_r
    if kind == "none":
        return torch.zeros_like(logp)
    raise ValueError(f"unknown KL estimator '{kind}'; allowed: k1, k3, none")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = 0.2, agg: str = "token-mean") -> torch.Tensor:
    """0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)."""
    err = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        err = torch.max(err, (clipped - returns) ** 2)
    return 0.5 * aggregate(err, mask, agg)


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean") -> torch.Tensor:
    """Negative log-likelihood of the target (action) tokens."""
    return aggregate(-logp, mask, agg)


def dpo_loss(pi_chosen: torch.Tensor, pi_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = 0.1) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO on sequence log-probs: -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), batch mean."""
    margin = beta * ((pi_chosen - ref_chosen) - (pi_rejected - ref_rejected))
    loss = -F.logsigmoid(margin).mean()
    margin = margin.detach()
    return loss, dict(reward_margin=float(margin.mean()), accuracy=float((margin > 0).float().mean()))


def ppo_objective(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                  cfg: dict[str, Any], ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The full policy objective a recipe configures: surrogate (+ Clip-Cov mask) + KL + entropy bonus."""
    agg = cfg.get("agg", "token-mean")
    keep = mask
    if cfg.get("clip_cov_ratio"):
        keep = clip_cov_mask(logp, adv, mask, cfg["clip_cov_ratio"], tuple(cfg.get("clip_cov_bounds", (1.0, 5.0))),
                             generator)
    loss, stats = policy_loss(logp, old_logp, adv, keep, cfg.get("eps_low", 0.2), cfg.get("eps_high", 0.2),
                              cfg.get("dual_clip"), agg, cfg.get("norm_len"))
    stats["clip_cov_masked"] = float((mask.to(keep.dtype) - keep).sum())
    kl_coef, kind = float(cfg.get("kl_coef", 0.0)), cfg.get("kl", "none")
    if kl_coef and kind != "none" and ref_logp is not None:
        kl = aggregate(kl_penalty(logp, ref_logp, kind), mask, agg)
        loss = loss + kl_coef * kl
        stats["kl"] = float(kl.detach())
    ent_coef = float(cfg.get("entropy_coef", 0.0))
    if entropy is not None:
        ent = aggregate(entropy, mask, agg)
        stats["entropy"] = float(ent.detach())
        if ent_coef:
            loss = loss - ent_coef * ent
    return loss, stats


LOSSES.register("ppo")(ppo_objective)
LOSSES.register("sft")(sft_loss)
LOSSES.register("dpo")(dpo_loss)
LOSSES.register("value")(value_loss)
