"""Estimators, losses and filters against values computed by hand on small tensors."""
import math

import pytest
import torch

from agentrl.algos.advantages import (ESTIMATORS, AdvantageInput, assign, discounted_returns, dr_grpo, gae, gigpo,
                                      grpo, reinforce_pp, reinforce_pp_baseline, rloo)
from agentrl.algos.filters import FILTERS, FilterContext, variance_filter
from agentrl.algos.losses import (Objective, aggregate, clip_cov_mask, dpo_loss, kl_penalty, policy_loss, ppo_objective,
                                  sft_loss, value_loss)
from agentrl.config import AlgoCfg
from agentrl.registry import RegistryError
from agentrl.types import Episode, Turn

R = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
G = ["a", "a", "a", "a", "b", "b"]


def test_grpo_by_hand():
    # group a: mean .5, population std .5 -> +-1; group b: mean .75, std .25 -> +-1
    adv = grpo(R, G, eps=0.0)
    assert adv.tolist() == pytest.approx([1, -1, -1, 1, 1, -1])


def test_dr_grpo_rloo_reinforce_pp_by_hand():
    assert dr_grpo(R, G).tolist() == pytest.approx([.5, -.5, -.5, .5, .25, -.25])
    # rloo: 1 - mean(0,0,1)=2/3; 0 - mean(1,0,1)=-2/3; group b: 1-.5=.5, .5-1=-.5
    assert rloo(R, G).tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, .5, -.5])
    mean, std = R.mean().item(), R.std(unbiased=False).item()
    assert reinforce_pp(R, G, eps=0.0).tolist() == pytest.approx(((R - mean) / std).tolist())
    # with a group baseline: dr_grpo's [.5, -.5, -.5, .5, .25, -.25], divided by their batch std
    centred = [.5, -.5, -.5, .5, .25, -.25]
    bstd = math.sqrt(sum(c * c for c in centred) / 6 - (sum(centred) / 6) ** 2)
    assert reinforce_pp_baseline(R, G, eps=0.0).tolist() == pytest.approx([c / bstd for c in centred])
    with pytest.raises(RegistryError, match="unknown advantage estimator 'grpoo'; allowed: .*grpo"):
        ESTIMATORS.get("grpoo")


def test_gae_by_hand():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae(r, v, gamma=0.9, lam=0.8)
    d2 = 1.0 - 0.7
    d1 = 0.0 + 0.9 * 0.7 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2, a1 = d2, d1 + 0.9 * 0.8 * d2
    a0 = d0 + 0.9 * 0.8 * a1
    assert adv[0].tolist() == pytest.approx([a0, a1, a2])
    assert ret[0].tolist() == pytest.approx([a0 + .5, a1 + .6, a2 + .7])
    # right padding: the padded step neither contributes nor receives advantage
    adv_p, _ = gae(torch.tensor([[0.0, 1.0, 9.0]]), torch.tensor([[0.5, 0.6, 9.0]]), 1.0, 1.0,
                   mask=torch.tensor([[1, 1, 0]]))
    assert adv_p[0].tolist() == pytest.approx([0.0 + 0.6 - 0.5 + (1.0 - 0.6), 1.0 - 0.6, 0.0])


def test_token_level_gae_over_a_multi_turn_episode_by_hand():
    """StarPO-PPO: one episode, turns of 2 and 3 generated tokens, turn rewards 0.2 and 1.0 on each turn's
    last token, a value per token; env tokens are not in the sequence."""
    x = AdvantageInput(torch.tensor([1.2]), ["a"], [[0.2, 1.0]], [[0.2, 1.0]], gamma=0.9, lam=0.8,
                       token_values=[[0.1, 0.2, 0.3, 0.4, 0.5]], turn_tokens=[[2, 3]])
    out = ESTIMATORS.get("gae_token")(x)
    # deltas r + 0.9 v' - v, then A_t = delta_t + 0.72 A_{t+1}
    a4 = 1.0 - 0.5
    a3 = (0.9 * 0.5 - 0.4) + 0.72 * a4
    a2 = (0.9 * 0.4 - 0.3) + 0.72 * a3
    a1 = (0.2 + 0.9 * 0.3 - 0.2) + 0.72 * a2
    a0 = (0.9 * 0.2 - 0.1) + 0.72 * a1
    assert out.per_token[0] == pytest.approx([a0, a1, a2, a3, a4])  # 0.4585, 0.5257, 0.3552, 0.41, 0.5
    assert out.token_returns[0] == pytest.approx([a0 + .1, a1 + .2, a2 + .3, a3 + .4, a4 + .5])
    assert out.per_turn[0] == pytest.approx([a0, a2])  # each turn's first token, for the logs
    with pytest.raises(ValueError, match="per-token values"):
        ESTIMATORS.get("gae_token")(AdvantageInput(torch.tensor([1.0]), ["a"], [[1.0]], [[1.0]]))


def test_token_targets_land_on_generated_tokens_only():
    from agentrl.learner.batch import collate, episode_sample, with_token_targets

    # a full-chat episode: turn 2's prompt holds turn 1's prompt and generation, then env tokens 7, 8
    t1 = Turn([1, 2], [3, 4], [-0.1, -0.2], "", [], True, "", 0.0, False, "stop")
    t2 = Turn([1, 2, 3, 4, 7, 8], [5, 6, 9], [-0.3, -0.4, -0.5], "", [], True, "", 1.0, True, "stop")
    ep = Episode("sokoban", "train/00000", 0, turns=[t1, t2])
    s = with_token_targets(episode_sample(ep, [0.0, 0.0]), [1, 2, 3, 4, 5], [10, 20, 30, 40, 50], [.1, .2, .3, .4, .5])
    assert s.loss_mask == s.value_mask == [0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert s.advantages == [0, 0, 1, 2, 0, 0, 3, 4, 5] and s.returns == [0, 0, 10, 20, 0, 0, 30, 40, 50]
    b = collate([s], 0)  # on targets: position i predicts token i + 1
    assert b.value_mask[0].tolist() == b.loss_mask[0].tolist() == [0, 1, 1, 0, 0, 1, 1, 1]
    assert b.returns[0].tolist() == [0, 10, 20, 0, 0, 30, 40, 50]
    with pytest.raises(ValueError, match="5 generated tokens but 4 advantages"):
        with_token_targets(episode_sample(ep, [0.0, 0.0]), [1, 2, 3, 4], [1] * 5, [1] * 5)


def test_gigpo_step_groups_by_hand():
    # two trajectories of one group pass the same anchor state "s1" at steps 1 and 0
    step_rewards = [[0.0, 0.0, 1.0], [0.0, 0.0]]
    anchors = [["s0", "s1", "s2"], ["s1", "s3"]]
    rewards = torch.tensor([1.0, 0.0])
    out = gigpo(rewards, ["g", "g"], step_rewards, anchors, gamma=1.0, step_weight=1.0, eps=0.0,
                normalize_std=False)
    # episode advantages: +.5 / -.5; step returns: traj0 [1,1,1], traj1 [0,0]
    # anchor s1: returns {1 (traj0 t1), 0 (traj1 t0)} -> centred +.5 / -.5; singletons get 0
    assert out[0].tolist() == pytest.approx([0.5, 1.0, 0.5])
    assert out[1].tolist() == pytest.approx([-1.0, -0.5])
    assert discounted_returns([0, 0, 1], 0.5) == [0.25, 0.5, 1.0]
    assert [t.tolist() for t in assign(torch.tensor([2.0, -1.0]), [2, 1])] == [[2.0, 2.0], [-1.0]]


def test_every_estimator_takes_one_input_and_declares_what_it_needs():
    x = AdvantageInput(R, G, [[0.0, r] for r in R.tolist()], [[0.0, r] for r in R.tolist()])
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        est = ESTIMATORS.get(name)
        assert not est.needs_values and not est.needs_anchors
        out = est(x)  # one advantage per episode, on each of its two turns
        assert [a for a, b in out.per_turn] == [b for a, b in out.per_turn] and out.returns is None
    assert ESTIMATORS.get("grpo")(x).per_turn[0][0] == pytest.approx(float(grpo(R, G)[0]))
    assert ESTIMATORS.get("gae").needs_values and ESTIMATORS.get("gigpo").needs_anchors
    with pytest.raises(ValueError, match="'gae' needs the critic's values"):
        ESTIMATORS.get("gae")(x)
    x.values = [[0.5, 0.25]] * 6
    out = ESTIMATORS.get("gae")(x)  # gamma = lam = 1: A_t = sum of rewards from t - V_t; returns = A + V
    assert out.per_turn[0] == pytest.approx([1.0 - 0.5, 1.0 - 0.25]) and out.returns[0] == pytest.approx([1.0, 1.0])
    x.whiten = True  # every turn of the batch: mean 0, std 1
    flat = torch.tensor([a for row in ESTIMATORS.get("gae")(x).per_turn for a in row])
    assert float(flat.mean()) == pytest.approx(0.0, abs=1e-6) and float(flat.std(unbiased=False)) == pytest.approx(1.0)


MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
X = torch.tensor([[1.0, 3.0, 100.0], [5.0, 100.0, 100.0]])


def test_aggregation_modes_by_hand():
    assert aggregate(X, MASK, "token-mean").item() == pytest.approx((1 + 3 + 5) / 3)
    assert aggregate(X, MASK, "seq-mean-token-mean").item() == pytest.approx((2 + 5) / 2)
    assert aggregate(X, MASK, "seq-mean-token-sum").item() == pytest.approx((4 + 5) / 2)
    assert aggregate(X, MASK, "seq-mean-token-sum-norm", norm_len=4).item() == pytest.approx((4 / 4 + 5 / 4) / 2)
    with pytest.raises(ValueError, match="allowed: token-mean"):
        aggregate(X, MASK, "mean")


def test_clip_higher_asymmetry_and_dual_clip():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.25, 1.25, 0.7, 3.0]]))
    adv = torch.tensor([[1.0, -1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, stats = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, agg="seq-mean-token-sum")
    # tok0: r=1.25 < 1.28 not clipped -> -1.25; tok1 A<0: min(-1.25, -1.25) -> 1.25
    # tok2: r=.7 clipped at .8 for A<0 -> -min(-.7, -.8) = .8; tok3: r=3, A<0 -> 3
    assert loss.item() == pytest.approx(-1.25 + 1.25 + 0.8 + 3.0)
    assert stats["clip_frac"] == pytest.approx(1 / 4)  # only tok2 (r below 1-eps_low with A<0)
    sym, _ = policy_loss(logp, old, adv, mask, 0.2, 0.2, agg="seq-mean-token-sum")
    assert sym.item() == pytest.approx(-1.2 + 1.25 + 0.8 + 3.0)  # tok0 clipped at 1.2 with eps_high .2
    dual, _ = policy_loss(logp, old, adv, mask, 0.2, 0.28, dual_clip=2.0, agg="seq-mean-token-sum")
    assert dual.item() == pytest.approx(-1.25 + 1.25 + 0.8 + 2.0)  # tok3 bounded by C*|A| = 2


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - 1 - math.log(0.5))
    assert kl_penalty(logp, ref, "none").item() == 0.0


def test_clip_cov_masks_the_requested_fraction_inside_the_band():
    gen = torch.Generator().manual_seed(0)
    logp = torch.linspace(-3, 0, 1000)[None]
    adv = torch.linspace(-3, 3, 1000)[None]
    mask = torch.ones(1, 1000)
    keep = clip_cov_mask(logp, adv, mask, clip_ratio=0.01, bounds=(1.0, 5.0), generator=gen)
    dropped = (keep == 0)[0]
    assert int(dropped.sum()) == 10  # 1% of 1000 valid tokens
    cov = (logp - logp.mean()) * (adv - adv.mean())
    assert bool(((cov[0][dropped] > 1.0) & (cov[0][dropped] < 5.0)).all())
    obj = Objective.of(AlgoCfg(clip_cov_ratio=0.01))
    loss, stats = ppo_objective(logp, logp.detach(), adv, mask, obj, generator=gen)
    assert stats["clip_cov_masked"] == 10


def test_value_sft_dpo_by_hand():
    v, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.0]]), torch.tensor([[0.0, 1.0]])
    # tok0: (1-0)^2=1 vs clipped V=.7 -> .49 -> max 1; tok1: (0-1)^2 = 1 both -> .5 * mean(1, 1)
    assert value_loss(v, old, ret, torch.ones(1, 2), clip=0.2).item() == pytest.approx(0.5)
    assert sft_loss(torch.log(torch.tensor([[0.5, 0.25]])), torch.tensor([[1, 0]])).item() == pytest.approx(math.log(2))
    loss, stats = dpo_loss(torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.5]),
                           beta=0.5)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.5 * (0.5 + 0.5)))))
    assert stats["accuracy"] == 1.0


def _ep(group, reward, finish="stop", actions=("a",), fmt=True):
    t = Turn([1], [2], [0.0], "", list(actions), fmt, "", reward, True, finish)
    return Episode("e", "t", 0, group_id=group, turns=[t])


def test_variance_filter_keeps_top_groups():
    eps = [_ep("flat", 1.0), _ep("flat", 1.0), _ep("mixed", 1.0), _ep("mixed", 0.0), _ep("some", .5), _ep("some", 0.)]
    kept, dropped = variance_filter(eps, FilterContext(variance_keep=0.5))
    assert {e.group_id for e in kept} == {"mixed", "some"} and dropped == 2
    kept, _ = FILTERS.get("variance")(eps, FilterContext(variance_keep=0.25))
    assert {e.group_id for e in kept} == {"mixed"}


def test_other_filters():
    eps = [_ep("g", 1.0, finish="length"), _ep("g", 1.0, actions=()), _ep("g", 1.0, fmt=False), _ep("g", 0.0)]
    assert FILTERS.get("overlong")(eps)[1] == 1
    assert FILTERS.get("void_turn")(eps)[1] == 1
    assert FILTERS.get("invalid_format")(eps)[1] == 1
    eps[3].dropped = True
    assert FILTERS.get("dropped")(eps)[1] == 1


def test_zero_variance_filter_drops_groups_with_equal_rewards():
    from agentrl.algos.filters import zero_variance_filter
    from agentrl.types import Episode

    eps = [Episode("e", "t", 0, g, won=w) for g, w in [("a", 0), ("a", 0), ("b", 1), ("b", 0), ("c", 1), ("c", 1)]]
    kept, dropped = zero_variance_filter(eps, FilterContext(reward=lambda e: float(e.won)))
    assert [e.group_id for e in kept] == ["b", "b"] and dropped == 4


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_a_group_of_equal_rewards_float32_cannot_represent_gets_zero_advantage(name):
    # 0.1 is not exact in float32: mean - r is ~1e-9 and grpo's division by (std + eps) blew it up to ~-0.007
    r = torch.full((8,), 0.1)
    r = torch.cat([r, torch.tensor([1.0, 0.0])])
    fn = dict(grpo=grpo, dr_grpo=dr_grpo, rloo=rloo, reinforce_pp=reinforce_pp)[name]
    adv = fn(r, ["a"] * 8 + ["b", "b"])
    if name == "reinforce_pp":  # one batch-level baseline: only an all-equal batch is exactly zero
        adv = fn(torch.full((8,), 0.1), ["a"] * 8)
        assert adv.tolist() == [0.0] * 8
    else:
        assert adv[:8].tolist() == [0.0] * 8
        assert adv[8] > 0 > adv[9]


def test_policy_loss_survives_a_stale_sample_and_nan_at_masked_positions():
    logp = torch.tensor([[-0.1, -0.2, float("nan")]], requires_grad=True)
    old = torch.tensor([[-200.0, -0.2, 0.0]])  # a ratio of e^199.9 overflows float32 without a clamp
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in stats.values())
    # token 0 is clipped at 1.2 (no gradient), token 1 has ratio 1: loss = -(1.2 + 1) / 2
    assert loss.item() == pytest.approx(-1.1)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 2] == 0
    assert aggregate(torch.tensor([[1.0, float("nan")]]), torch.tensor([[1, 0]])).item() == 1.0
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        assert math.isfinite(aggregate(torch.tensor([[1.0, float("inf")]]), torch.tensor([[1, 0]]), mode).item())


def _shaped_episode(won):
    # as the rollout engine leaves it: turn 0 unparsable (reward = the format penalty), turn 1 the env's 0.5
    bad = Turn([1], [2], [0.0], "??", [], False, "o1", -0.1, False)
    good = Turn([1, 2, 3], [4], [0.0], "<action>a</action>", ["a"], True, "o2", 0.5, True)
    return Episode("sokoban", "t", 0, group_id="g", turns=[bad, good], won=won)


@pytest.mark.parametrize("kind,expected", [("env_return", 0.4), ("success", 0.9)])
def test_penalties_in_the_turn_rewards_are_counted_once(kind, expected):
    from agentrl.config_loader import load_config
    from agentrl.recipe import GroupRecipe

    cfg = load_config("grpo", env="sokoban", overrides=[f"algo.reward={kind}", "rollout.format_penalty=-0.1",
                                                        "algo.estimator=gae", "algo.filters=[]", "algo.gamma=1.0",
                                                        "algo.turn_weight=uniform",
                                                        "algo.lam=1.0"])
    recipe = GroupRecipe(cfg)
    ep = _shaped_episode(won=True)
    assert recipe.reward(ep) == pytest.approx(expected)

    class ZeroCritic:  # values 0 with gamma = lam = 1: the first turn's advantage is the whole return
        def values(self, s):
            return [0.0] * len(s)

    samples, _ = recipe.make_batch(ZeroCritic(), [ep])
    first = samples[0].advantages[samples[0].loss_mask.index(1)]
    assert first == pytest.approx(expected)
    assert samples[0].returns[samples[0].loss_mask.index(1)] == pytest.approx(expected)


def test_progress_coef_ranks_failed_episodes_by_progress():
    from agentrl.config import ConfigError
    from agentrl.config_loader import load_config
    from agentrl.recipe import GroupRecipe

    recipe = GroupRecipe(load_config("grpo", env="sokoban", overrides=["algo.progress_coef=0.5"]))
    far, near = (Episode("sokoban", "t", 0, group_id="g", turns=[_shaped_episode(False).turns[1]], progress=p)
                 for p in (0.0, 0.4))
    won = Episode("sokoban", "t", 0, group_id="g", turns=[_shaped_episode(True).turns[1]], won=True, progress=1.0)
    assert [recipe.reward(e) for e in (far, near, won)] == pytest.approx([0.0, 0.2, 1.5])
    # an all-fail group keeps a group-relative signal: the episode that got nearer is pushed up
    samples, _ = recipe.make_batch(None, [far, near])
    assert [s.advantages[s.loss_mask.index(1)] for s in samples] == pytest.approx([-1.0, 1.0], abs=1e-4)
    for bad in (["algo.progress_coef=-1"], ["algo.progress_coef=0.5", "algo.reward=env_return"]):
        with pytest.raises(ConfigError, match="algo.progress_coef"):
            load_config("grpo", env="sokoban", overrides=bad)


def _loss(name, logp, old, adv, mask, **cfg):
    from agentrl.algos.losses import LOSSES

    logp = logp.clone().requires_grad_(True)
    loss, stats = LOSSES.get(name)(logp, old, adv, mask, Objective.of(AlgoCfg(loss=name), **cfg))
    loss.backward()
    return loss.item(), logp.grad, stats


def test_gspo_uses_one_ratio_per_sequence_by_hand():
    # row 0: log-ratios .3 and -.1 -> s = exp(.1), above 1 + .05 with A > 0: clipped (no gradient),
    # although its second token alone would not be; row 1: log-ratio .02 (one token) -> s = exp(.02),
    # inside [.95, 1.05]: loss -s * A
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    old = torch.tensor([[-1.3, -1.9], [-0.52, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, grad, stats = _loss("gspo", logp, old, adv, mask, eps_low=0.05, eps_high=0.05)
    row0 = -(1 + 0.05) * 1.0
    row1 = -math.exp(0.02) * -2.0
    assert loss == pytest.approx((row0 + row1) / 2, rel=1e-5)
    assert grad[0].tolist() == [0.0, 0.0]  # clipped sequence
    # d/dlogp of -s*A/2 (seq-mean of a 1-token row, mean over 2 rows) = -s*A/2 at the one token
    assert grad[1, 0].item() == pytest.approx(math.exp(0.02) * 2.0 / 2, rel=1e-5) and grad[1, 1] == 0
    assert stats["clip_frac"] == pytest.approx(2 / 3)


def test_cispo_keeps_a_gradient_on_clipped_tokens_by_hand():
    # ratios e^.5 (clipped to 1.2) and 1; loss = -mean(w * A * logp), w detached
    logp = torch.tensor([[-1.0, -2.0]])
    old = torch.tensor([[-1.5, -2.0]])
    adv = torch.tensor([[1.0, -1.0]])
    loss, grad, _ = _loss("cispo", logp, old, adv, torch.tensor([[1, 1]]), eps_low=0.2, eps_high=0.2)
    assert loss == pytest.approx(-(1.2 * 1.0 * -1.0 + 1.0 * -1.0 * -2.0) / 2)
    assert grad[0].tolist() == pytest.approx([-1.2 / 2, 1.0 / 2])  # PPO would give token 0 no gradient


def test_kl_cov_penalizes_only_the_highest_covariance_tokens_by_hand():
    logp = torch.tensor([[-0.1, -3.0, -1.0, -2.0]])
    old = logp - torch.tensor([[0.5, 0.0, 0.0, 0.0]])  # token 0 moved by log-ratio .5
    adv = torch.tensor([[2.0, -1.0, 0.0, 0.0]])
    # centred logp: mean -1.525 -> token 0: +1.425 x (A - .25 = 1.75) is the largest covariance
    loss, _, stats = _loss("kl_cov", logp, old, adv, torch.tensor([[1, 1, 1, 1]]), kl_cov_ratio=0.25, kl_cov_coef=1.0)
    assert stats["kl_cov_tokens"] == 1.0
    surrogate = -(math.exp(0.5) * 2.0) - 1.0 * -1.0
    assert loss == pytest.approx((surrogate + 0.5) / 4, rel=1e-5)


def test_ppo_objective_looks_the_surrogate_up_by_name_and_k2_kl():
    logp, old = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]])
    adv, mask = torch.tensor([[1.0, -1.0]]), torch.tensor([[1, 1]])
    for name in ("ppo", "cispo"):
        direct, _, _ = _loss(name, logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
        assert ppo_objective(logp, old, adv, mask, Objective.of(AlgoCfg(loss=name)))[0].item() == pytest.approx(direct)
    with pytest.raises(RegistryError, match="unknown policy loss 'gpso'; allowed: cispo, gspo, kl_cov, ppo"):
        ppo_objective(logp, old, adv, mask, Objective.of(AlgoCfg(loss="gpso")))
    ref = torch.tensor([[-1.2, -2.5]])
    assert kl_penalty(logp, ref, "k2")[0].tolist() == pytest.approx([0.5 * 0.2 ** 2, 0.5 * 0.5 ** 2])


def test_adaptive_kl_controller_by_hand():
    from agentrl.algos.kl_control import KLController

    c = KLController(0.1, target=2.0, horizon=100)
    c.update(3.0, 10)  # error 3/2 - 1 = .5, clipped to .2: coef x (1 + .2 * 10 / 100)
    assert c.coef == pytest.approx(0.1 * 1.02)
    c.update(1.9, 10)  # error -.05
    assert c.coef == pytest.approx(0.1 * 1.02 * (1 - 0.05 * 0.1))
    fixed = KLController(0.1)
    fixed.update(100.0, 10)
    assert fixed.coef == 0.1
    d = KLController(0.5, target=1.0)
    d.load_state_dict(c.state_dict())
    assert d.coef == c.coef


def test_kl_reward_penalty_lowers_each_episode_reward_by_coef_times_its_kl():
    from agentrl.config_loader import load_config
    from agentrl.recipe import GroupRecipe

    cfg = load_config("grpo", env="sokoban", overrides=["algo.kl_reward_coef=0.5", "algo.filters=[]",
                                                        "algo.turn_weight=uniform", "algo.estimator=dr_grpo"])
    recipe = GroupRecipe(cfg)
    eps = [_shaped_episode(won=True), _shaped_episode(won=False)]
    for e in eps:
        e.group_id = "g"
        for t in e.turns:
            t.gen_logprobs = [-1.0] * len(t.gen_ids)

    class Engine:  # the reference gives every token log-prob -1.5: KL 0.5 per generated token
        pad_id = 0

        def ref_logprobs(self, batch, temperature=1.0):
            return torch.full_like(batch.old_logprobs, -1.5)

    class T:
        engine = Engine()

    samples, stats = recipe.make_batch(T(), eps)
    # each episode generated 2 tokens (one per turn): KL 1.0, penalty 0.5; rewards 1 -> .5 and 0 -> -.5,
    # dr_grpo: +-0.5 (the penalty is the same for both, so it cancels in the advantage)
    assert stats["kl_episode"] == pytest.approx(1.0) and stats["kl_reward_coef"] == 0.5
    assert sorted({s.meta["reward"] for s in samples}) == pytest.approx([-0.5, 0.5])
    assert recipe.state_dict() == {"kl_ctl": {"coef": 0.5}}
