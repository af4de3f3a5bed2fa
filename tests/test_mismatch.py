"""algo.mismatch: the sampler/learner log-prob mismatch corrected on every step, truncated (tis) or masked per
sequence (mis), from one learner pass (docs/guides/async.md)."""
import math
import random

import pytest
import torch

from agentrl.algos.losses import behaviour_weights, policy_loss
from agentrl.config_loader import load_config


def test_tis_truncates_each_tokens_weight_at_the_cap():
    behav = torch.log(torch.tensor([[0.2, 0.5, 0.4]]))
    prox = torch.log(torch.tensor([[0.3, 0.5 * 2.5, 0.4]]))  # ratios 1.5, 2.5 (truncated to 2), 1
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w, stats = behaviour_weights(prox, behav, mask, cap=2.0, mode="tis")
    assert torch.allclose(w, torch.tensor([[1.5, 2.0, 1.0]]))
    assert stats["behav_is_truncated_frac"] == 0.5 and stats["behav_is_mean"] == pytest.approx(1.75)
    # k3 estimate of KL(behav || prox) over the two generated tokens: (r - 1) - log r
    want = ((1.5 - 1 - math.log(1.5)) + (2.5 - 1 - math.log(2.5))) / 2
    assert stats["mismatch_kl"] == pytest.approx(want, rel=1e-5)


def test_mis_masks_a_sequence_whose_geometric_mean_ratio_leaves_the_bounds():
    behav = torch.log(torch.full((3, 2), 0.2))
    # row 0: ratios 1.5, 1.5 (mean 1.5: kept, weight 1.5); row 1: 4 and 1.5 (sqrt 6 = 2.45 > 2: masked);
    # row 2: 0.3 and 1 (sqrt 0.3 = 0.55, inside [0.5, 2]: kept with that weight)
    prox = torch.log(torch.tensor([[0.3, 0.3], [0.8, 0.3], [0.06, 0.2]]))
    mask = torch.ones(3, 2)
    w, stats = behaviour_weights(prox, behav, mask, cap=2.0, mode="mis")
    assert torch.allclose(w[0], torch.tensor([1.5, 1.5]), rtol=1e-5)
    assert torch.equal(w[1], torch.zeros(2))
    assert torch.allclose(w[2], torch.full((2,), math.sqrt(0.3)), rtol=1e-5)
    assert stats["behav_is_masked_frac"] == pytest.approx(1 / 3)
    # a masked sequence takes no gradient from its advantage
    logp = prox.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, prox, torch.ones(3, 2) * w, mask)
    loss.backward()
    assert torch.equal(logp.grad[1], torch.zeros(2)) and bool(logp.grad[0].ne(0).all())


def test_equal_logprobs_give_weight_one_in_both_modes():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 6, generator=g) * 3
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    for mode in ("tis", "mis"):
        w, stats = behaviour_weights(lp, lp, mask, mode=mode)
        assert torch.equal(w, torch.ones_like(w)) and stats["mismatch_kl"] == 0.0


def test_auto_corrects_when_vllm_samples_and_not_otherwise():
    from agentrl.learner.loop import mismatch_mode

    cfg = load_config("grpo", env="sokoban")
    assert cfg.algo.mismatch == "auto" and mismatch_mode(cfg) == "none"  # the embedded generator: exact
    cfg.trainer.generator = "vllm"
    assert mismatch_mode(cfg) == "tis"
    cfg.algo.mismatch = "mis"
    assert mismatch_mode(cfg) == "mis"
    cfg.trainer.generator, cfg.algo.mismatch = "embedded", "tis"
    assert mismatch_mode(cfg) == "tis"  # asked for: on with any generator


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_a_corrected_update_is_the_plain_update_on_reweighted_advantages(tiny_model_dir, mode):
    """The wiring: rl_update with algo.mismatch takes the ratio against the learner's log-probs and weights the
    advantages by behaviour_weights, exactly as a plain update on the learner's log-probs and weighted advantages."""
    from agentrl.learner.batch import collate
    from agentrl.learner.engine import TorchEngine
    from agentrl.learner.loop import rl_update
    from agentrl.recipe import RECIPES
    from tests.test_learner import _samples

    def batch_and_engine():
        eng = TorchEngine(tiny_model_dir)
        batch = collate(_samples(n=6, seed=2), eng.pad_id)
        learner = eng.logprobs(batch, 1.0)
        noise = torch.randn(batch.old_logprobs.shape, generator=torch.Generator().manual_seed(3)) * 0.4
        batch.old_logprobs = (learner + noise) * batch.loss_mask  # a sampler that is not quite the learner
        return eng, batch, learner

    overrides = [f"model.name={tiny_model_dir}", "algo.mini_batches=2"]
    got_cfg = load_config("grpo", env="sokoban", overrides=overrides + [f"algo.mismatch={mode}"])
    want_cfg = load_config("grpo", env="sokoban", overrides=overrides + ["algo.mismatch=none",
                                                                         "algo.old_logprobs=learner"])
    loss_fn = RECIPES.get("grpo")(got_cfg).loss_fn(None)

    eng, batch, _ = batch_and_engine()
    stats = rl_update(eng, batch, loss_fn, got_cfg, random.Random(0), 1, None)
    assert stats["mismatch_kl"] > 0 and stats["old_logprob_gap"] > 0
    assert (f"behav_is_{'masked' if mode == 'mis' else 'truncated'}_frac") in stats

    ref, plain, learner = batch_and_engine()
    w, _ = behaviour_weights(learner, plain.old_logprobs, plain.loss_mask, 2.0, mode)
    plain.advantages = plain.advantages * w
    rl_update(ref, plain, loss_fn, want_cfg, random.Random(0), 1, None)
    for (n, p), (_, q) in zip(eng.model.named_parameters(), ref.model.named_parameters()):
        assert torch.allclose(p, q, atol=1e-6), n
