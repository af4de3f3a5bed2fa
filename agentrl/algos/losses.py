"""Losses over token tensors (B, T) with a loss mask that is 1 only on policy-generated tokens.

Policy surrogates are registered in ``LOSSES`` (``algo.loss``), one signature each:
``fn(logp, old_logp, adv, mask, obj: Objective) -> (loss, stats)``: ``ppo`` (clipped surrogate with decoupled clip
range eps_low/eps_high, DAPO's clip-higher, and dual clip), ``gspo`` (sequence-level ratio), ``cispo``
(clipped, detached importance weight on a REINFORCE term), ``kl_cov`` (KL penalty on the tokens of
highest covariance). ``ppo_objective`` adds to the chosen surrogate the Clip-Cov mask, a KL penalty
(k1/k2/k3) and the entropy bonus, over four aggregation modes. ``behaviour_weights`` decouples the
behaviour policy from the proximal one: for stale samples, and for a sampler whose kernels or dtype differ
from the learner's (truncated or masked importance sampling, ``algo.mismatch``). Also the clipped value
loss, SFT (NLL on action tokens) and DPO.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from agentrl.registry import Registry

LOSSES = Registry("policy loss")
LOG_RATIO_CLAMP = 20.0  # |log pi/pi_old| beyond this is clipped anyway (e^20 ~ 5e8)
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class Objective:
    """The policy objective's settings: the ``algo.*`` keys of the same names and ``norm_len`` (the
    rollout's ``max_new_tokens``). No defaults here: each key has its one in ``agentrl.config.AlgoCfg``,
    and ``of`` reads them from it (by name: the losses sit below the config)."""

    loss: str
    eps_low: float
    eps_high: float
    dual_clip: float | None
    agg: str
    kl: str
    kl_coef: float
    entropy_coef: float
    clip_cov_ratio: float
    kl_cov_ratio: float
    kl_cov_coef: float
    norm_len: int | None = None
    clip_cov_bounds: tuple[float, float] = (1.0, 5.0)  # Clip-Cov's covariance window (the paper's; no config key)

    @classmethod
    def of(cls, algo: Any, norm_len: int | None = None, **over: Any) -> "Objective":
        """The objective of ``algo`` (an ``AlgoCfg``), with ``over`` replacing any setting."""
        keys = {f.name: getattr(algo, f.name) for f in fields(cls) if f.name not in ("norm_len", "clip_cov_bounds")}
        return cls(**dict(keys, norm_len=norm_len, **over))


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


def _centred_cov(logp: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(logp - mean logp) * (A - mean A) of each valid token, means over the valid tokens (Cui et al.)."""
    lp, a = logp.detach()[valid], adv.detach()[valid]
    return (lp - lp.mean()) * (a - a.mean())


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
    cov = _centred_cov(logp, adv, valid)
    candidates = torch.nonzero((cov > bounds[0]) & (cov < bounds[1]))[:, 0]
    k = min(len(candidates), max(1, int(clip_ratio * n))) if len(candidates) else 0
    if k:
        chosen = candidates[torch.randperm(len(candidates), generator=generator)[:k]]
        flat = keep[valid]
        flat[chosen] = 0.0
        keep[valid] = flat
    return keep


def _log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    # clamped before exp: a stale sample's log-ratio of +-100 would give inf (and inf * 0 = NaN)
    return torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _ratio_stats(ratio: torch.Tensor, log_ratio: torch.Tensor, clipped: torch.Tensor, m: torch.Tensor
                 ) -> dict[str, float]:
    with torch.no_grad():
        return dict(clip_frac=float(aggregate(clipped.to(m.dtype), m)),
                    approx_kl=float(aggregate((ratio - 1) - log_ratio, m)),
                    ratio_mean=float(aggregate(ratio, m)))


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None,
                agg: str = "token-mean", norm_len: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), with dual clip
    max(., C A)-bounded loss for A < 0 when ``dual_clip`` (C > 1) is set."""
    log_ratio = _log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    loss = -torch.min(surr1, surr2)
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip constant must be > 1, got {dual_clip}")
        loss = torch.where(adv < 0, torch.min(loss, -dual_clip * adv), loss)
    clipped = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
    return aggregate(loss, mask, agg, norm_len), _ratio_stats(ratio, log_ratio, clipped, mask.to(logp.dtype))


@LOSSES.register("ppo")
def ppo_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                  cfg: Objective) -> tuple[torch.Tensor, dict[str, float]]:
    return policy_loss(logp, old_logp, adv, mask, cfg.eps_low, cfg.eps_high, cfg.dual_clip, cfg.agg, cfg.norm_len)


@LOSSES.register("gspo")
def gspo_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                   cfg: Objective) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al., 2025): one importance ratio per sequence, the geometric mean of its tokens'
    s = exp(mean_t log(pi/pi_old)), clipped PPO-style (the paper's ranges are ~3e-4/4e-4: set algo.eps_low and
    algo.eps_high to them, their defaults are PPO's) and averaged
    per sequence, then over sequences. Per token it is written s_t = sg[s] * pi_t / sg[pi_t], which has
    the same value and lets a per-token advantage through (GSPO-token)."""
    m = mask.to(logp.dtype)
    log_ratio = _log_ratio(logp, old_logp)
    seq = torch.where(m > 0, log_ratio, torch.zeros_like(log_ratio)).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = torch.clamp(seq.detach()[:, None] + logp - logp.detach(), max=LOG_RATIO_CLAMP)
    s = torch.exp(log_s)
    eps_low, eps_high = cfg.eps_low, cfg.eps_high
    loss = -torch.min(s * adv, torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv)
    clipped = ((s < 1 - eps_low) & (adv < 0)) | ((s > 1 + eps_high) & (adv > 0))
    return aggregate(loss, mask, "seq-mean-token-mean"), _ratio_stats(s, log_s, clipped, m)


@LOSSES.register("cispo")
def cispo_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                    cfg: Objective) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, 2025): -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi. The importance
    weight is clipped but detached, so every token keeps a gradient (PPO's clip zeroes the clipped
    tokens'); MiniMax sets no lower bound in practice (a large eps_low)."""
    log_ratio = _log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)
    eps_low, eps_high = cfg.eps_low, cfg.eps_high
    weight = torch.clamp(ratio, 1 - eps_low, 1 + eps_high).detach()
    loss = -weight * adv * logp
    clipped = (ratio < 1 - eps_low) | (ratio > 1 + eps_high)
    return (aggregate(loss, mask, cfg.agg, cfg.norm_len),
            _ratio_stats(ratio, log_ratio, clipped, mask.to(logp.dtype)))


def top_cov_mask(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, ratio: float) -> torch.Tensor:
    """1 on the ``ratio`` fraction (at least one) of valid tokens with the largest centred covariance
    (logp - mean logp) * (A - mean A) over the valid tokens, 0 elsewhere."""
    valid = mask.bool()
    out = torch.zeros_like(logp, dtype=torch.bool)
    n = int(valid.sum())
    if n == 0 or ratio <= 0:
        return out
    cov = _centred_cov(logp, adv, valid)
    k = max(1, int(ratio * n))
    flat = torch.zeros(n, dtype=torch.bool)
    flat[torch.topk(cov, k).indices] = True
    out[valid] = flat
    return out


@LOSSES.register("kl_cov")
def kl_cov_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                     cfg: Objective) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (Cui et al., 2025): the unclipped surrogate -r A, plus ``kl_cov_coef`` * |log r| on the
    ``kl_cov_ratio`` fraction of tokens whose covariance between log-prob and advantage is largest (the
    tokens that drive entropy collapse)."""
    log_ratio = _log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)
    chosen = top_cov_mask(logp, adv, mask, float(cfg.kl_cov_ratio))
    loss = -ratio * adv + chosen.to(logp.dtype) * float(cfg.kl_cov_coef) * log_ratio.abs()
    stats = _ratio_stats(ratio, log_ratio, chosen, mask.to(logp.dtype))
    stats["kl_cov_tokens"] = float(chosen.sum())
    return aggregate(loss, mask, cfg.agg, cfg.norm_len), stats


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from samples of pi: k1 = log(pi/ref); k2 = (log(pi/ref))^2 / 2
    (low variance, its gradient is the true KL's to first order); k3 = r - 1 - log r with r = ref/pi
    (Schulman's low-variance, unbiased, always >= 0)."""
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    if kind == "k3":
        log_r = ref_logp - logp
        return torch.exp(log_r) - 1 - log_r
    if kind == "none":
        return torch.zeros_like(logp)
    raise ValueError(f"unknown KL estimator '{kind}'; allowed: k1, k2, k3, none")


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


BEHAVIOUR_IS_CAP = 2.0  # algo.mismatch_cap's default: the behaviour importance weight's truncation


def behaviour_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
                      cap: float = BEHAVIOUR_IS_CAP, mode: str = "tis") -> tuple[torch.Tensor, dict[str, float]]:
    """The importance weight of samples drawn by a behaviour policy other than the learner's (an older policy:
    AReaL's decoupled PPO objective, Fu et al. 2025; or the same weights run by other kernels or in another
    dtype: vLLM). pi_behav sampled the token (its recorded log-prob), pi_prox is the learner's policy before
    this update; r = pi_prox / pi_behav per token, detached. The objective is then any surrogate against
    pi_prox with advantages w A, so the trust region is around the learner's policy.

    ``mode`` "tis" (truncated IS, token level): w = min(r, cap). "mis" (masked IS, sequence level): each row's
    ratio is the geometric mean of its tokens' r (length-normalized, as GSPO's); a row whose ratio leaves
    [1/cap, cap] gets w = 0 on every token (masked), the others w = that ratio. Equal log-probs give w = 1
    exactly in both. Stats: the mean weight, the fractions truncated (tis) or masked (mis), and
    ``mismatch_kl``, the k3 estimate of KL(pi_behav || pi_prox) over the generated tokens."""
    m = mask.to(prox_logp.dtype)
    log_r = _log_ratio(prox_logp.detach(), behav_logp.detach())
    r = torch.exp(log_r)
    stats = dict(mismatch_kl=float(aggregate((r - 1) - log_r, m)))
    if mode == "mis":
        rows = m.sum(-1).clamp(min=1)
        seq = torch.exp((log_r * m).sum(-1) / rows)  # (B,)
        keep = (seq <= cap) & (seq >= 1.0 / cap)
        w = torch.where(m > 0, torch.where(keep, seq, torch.zeros_like(seq))[:, None].expand_as(m),
                        torch.ones_like(m))
        has = m.sum(-1) > 0
        stats.update(behav_is_mean=float(aggregate(w, m)),
                     behav_is_masked_frac=float((~keep & has).sum()) / max(1, int(has.sum())))
        return w, stats
    if mode != "tis":
        raise ValueError(f"behaviour_weights: mode {mode!r} is not one of tis, mis")
    truncated = (r > cap) & (m > 0)
    w = torch.where(m > 0, r.clamp(max=cap), torch.ones_like(r))
    stats.update(behav_is_mean=float(aggregate(w, m)),
                 behav_is_truncated_frac=float(aggregate(truncated.to(m.dtype), m)))
    return w, stats


def ppo_objective(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                  cfg: Objective, ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The full policy objective a recipe configures: the ``LOSSES[cfg.loss]`` surrogate (+ Clip-Cov mask)
    + KL + entropy bonus."""
    agg = cfg.agg
    keep = mask
    if cfg.clip_cov_ratio:
        keep = clip_cov_mask(logp, adv, mask, cfg.clip_cov_ratio, tuple(cfg.clip_cov_bounds), generator)
    loss, stats = LOSSES.get(cfg.loss)(logp, old_logp, adv, keep, cfg)
    stats["clip_cov_masked"] = float((mask.to(keep.dtype) - keep).sum())
    kl_coef, kind = float(cfg.kl_coef), cfg.kl
    if kl_coef and kind != "none":
        if ref_logp is None:  # a configured KL that silently did nothing was a bug once
            raise ValueError(f"algo.kl={kind} with kl_coef={kl_coef} but the batch has no reference log-probs")
        kl = aggregate(kl_penalty(logp, ref_logp, kind), mask, agg)
        loss = loss + kl_coef * kl
        stats["kl"] = float(kl.detach())
    ent_coef = float(cfg.entropy_coef)
    if entropy is not None:
        ent = aggregate(entropy, mask, agg)
        stats["entropy"] = float(ent.detach())
        if ent_coef:
            loss = loss - ent_coef * ent
    return loss, stats
