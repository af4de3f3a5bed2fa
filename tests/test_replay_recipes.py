"""CRPS and SPEAR parts against the papers' equations, on hand-made inputs."""
import math

import pytest
import torch

from agentrl.buffers.sil import BaselineBuffer, SILBuffer, SILEntry, dual_filter
from agentrl.buffers.success import SuccessBuffer
from agentrl.curriculum.schedules import cosine_decay, cosine_warmup
from agentrl.curriculum.suffix_k import KController, initial_k, suffix_start
from agentrl.types import Episode, Turn


# ----- CRPS ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("acc,T,expected", [
    (0.0, 10, 2),   # floor(0.25 * 10) = 2
    (0.5, 10, 5),   # floor((0.25 + 0.5 * 0.5) * 10) = 5
    (1.0, 10, 7),   # floor(0.75 * 10) = 7
    (0.25, 8, 3),   # floor(0.375 * 8) = 3
    (0.0, 2, 1),    # floor(0.5) = 0 -> clipped to k_min = 1
    (1.0, 40, 20),  # floor(30) -> clipped to k_max = 20
])
def test_initial_k_eq9(acc, T, expected):
    assert initial_k(acc, T, beta_min=0.25, beta_max=0.75, k_min=1, k_max=20) == expected


def test_suffix_start_eq8():
    assert suffix_start(10, 3) == 7 and suffix_start(4, 9) == 0


def test_k_controller_follows_eq11_12_on_a_scripted_sequence():
    c = KController(k=4, k_min=1, k_max=9, lam=0.9, rho_low=0.2, rho_high=0.8, delta=2)
    rho = 0.5  # the EMA starts at the band's midpoint
    expected_k = 4
    for acc in [1.0, 1.0, 0.75, 0.5, 0.0, 0.0, 0.25, 1.0, 1.0, 1.0, 1.0]:
        rho = 0.1 * rho + 0.9 * acc  # eq. 11
        if rho > 0.8:
            expected_k = min(expected_k + 2, 9)  # eq. 12
        elif rho < 0.2:
            expected_k = max(expected_k - 2, 1)
        assert c.update(acc) == expected_k
        assert c.rho_hat == pytest.approx(rho)
    # the scripted path visits the caps: up 4->6->8, stays, down 8->6->4, stays, up 6->8->9->9
    c2 = KController(k=4, k_min=1, k_max=9)
    assert [c2.update(a) for a in [1.0, 1.0, 0.75, 0.5, 0.0, 0.0, 0.25, 1.0, 1.0, 1.0, 1.0]] == \
        [6, 8, 8, 8, 6, 4, 4, 6, 8, 9, 9]


def _episode(task="t1", seed=0, won=True, actions=("up", "left", "down"), start_index=0):
    turns = []
    for i, a in enumerate(actions):
        turns.append(Turn([1], [2], [-0.1], a, [a], True, f"obs{i + 1}", 0.0, i == len(actions) - 1,
                          fingerprints=[f"fp{i + 1}"]))
    return Episode("sokoban", task, seed, "g", instruction="push", initial_observation="obs0",
                   initial_fingerprint="fp0", turns=turns, won=won, start_index=start_index)


def test_success_buffer_gates_insertion_by_group_accuracy_eq7():
    buf = SuccessBuffer(capacity=4, alpha_max=0.5)
    ctrl = lambda: KController(1, 1, 3)  # noqa: E731
    assert not buf.offer(_episode(won=False), 0.25, ctrl())  # eq. 7 needs R = 1
    assert not buf.offer(_episode("easy"), 0.75, ctrl())  # acc > alpha_max: too easy
    assert buf.offer(_episode("hard"), 0.5, ctrl())  # acc = alpha_max is allowed
    assert not buf.offer(_episode("hard"), 0.25, ctrl())  # one entry per instance
    assert not buf.offer(_episode("replayed", start_index=2), 0.25, ctrl())  # suffix replays are not traces
    assert len(buf) == 1 and buf.counts["rejected_easy"] == 1 and buf.counts["duplicate"] == 1
    e = buf.entries["hard:0"]
    assert (e.T == 3 and e.trace.actions == ["up", "left", "down"]
            and e.trace.fingerprints == ["fp0", "fp1", "fp2", "fp3"])
    assert e.handover(1) == (2, 2) and e.history(2) == [("obs0", "up"), ("obs1", "left")]
    assert e.handover(5) == (0, 0)  # k >= T: from the initial state


def test_success_buffer_mastery_removal_and_fifo_and_state():
    buf = SuccessBuffer(capacity=2, alpha_max=1.0)
    for i in range(3):
        buf.offer(_episode(f"t{i}"), 0.5, KController(1, 1, 3), step=i)
    assert sorted(buf.entries) == ["t1:0", "t2:0"] and buf.counts["evicted_full"] == 1
    buf.record_replay("t1:0", 1.0, full_horizon=False, mastery_acc=1.0, mastery_patience=2)
    buf.record_replay("t1:0", 1.0, full_horizon=True, mastery_acc=1.0, mastery_patience=2)
    assert "t1:0" in buf.entries  # only one full-horizon success so far
    buf.record_replay("t1:0", 1.0, full_horizon=True, mastery_acc=1.0, mastery_patience=2)
    assert "t1:0" not in buf.entries and buf.counts["evicted_mastered"] == 1
    other = SuccessBuffer()
    other.load_state_dict(buf.state_dict())
    assert other.entries["t2:0"].to_dict() == buf.entries["t2:0"].to_dict()


def test_a_refusing_buffer_keeps_its_entries_until_they_are_mastered():
    buf = SuccessBuffer(capacity=2, alpha_max=1.0, when_full="refuse")
    assert [buf.offer(_episode(f"t{i}"), 0.5, KController(1, 1, 3), step=i) for i in range(3)] == [True, True, False]
    assert sorted(buf.entries) == ["t0:0", "t1:0"] and buf.refusing
    assert buf.counts["rejected_full"] == 1 and buf.counts["evicted_full"] == 0
    for _ in range(2):  # t0 mastered from its initial state: its place frees up
        buf.record_replay("t0:0", 1.0, full_horizon=True, mastery_acc=1.0, mastery_patience=2)
    assert not buf.refusing and buf.offer(_episode("t2"), 0.5, KController(1, 1, 3), step=3)
    assert sorted(buf.entries) == ["t1:0", "t2:0"]
    old = buf.state_dict()
    del old["counts"]["rejected_full"]  # a checkpoint written before the counter existed
    other = SuccessBuffer(capacity=2, when_full="refuse")
    other.load_state_dict(old)
    assert not other.offer(_episode("t3"), 0.5, KController(1, 1, 3)) and other.counts["rejected_full"] == 1


# ----- SPEAR --------------------------------------------------------------------------------------
def test_spear_schedules_eq13_eq14():
    assert cosine_warmup(0, 100) == 0.0 and cosine_warmup(50, 100) == pytest.approx(0.5)
    assert cosine_warmup(25, 100) == pytest.approx(0.5 * (1 - math.cos(math.pi / 4)))
    assert cosine_warmup(100, 100) == pytest.approx(1.0) and cosine_warmup(101, 100) == 1.0
    assert cosine_decay(0, 200) == 1.0 and cosine_decay(100, 200) == pytest.approx(0.5)
    assert cosine_decay(150, 200) == pytest.approx(0.5 * (math.cos(math.pi * 0.75) + 1))
    assert cosine_decay(200, 200) == pytest.approx(0.0) and cosine_decay(201, 200) == 0.0


def test_p50_recalibration_and_dual_filter_on_a_hand_made_buffer():
    base = BaselineBuffer(capacity=4)
    for m in [0.9, -1.0, 0.2, 0.4, 0.6]:  # FIFO: 0.9 falls out
        base.add(m)
    assert list(base.values) == [-1.0, 0.2, 0.4, 0.6] and base.p50() == pytest.approx(0.3)
    sil = SILBuffer(capacity=3)
    assert not sil.add(SILEntry([], reward=1.0, adv=0.0))  # eq. 1: only positive advantages
    for r, a in [(1.1, 0.8), (0.2, 0.5), (1.0, 1.2)]:
        assert sil.add(SILEntry([], reward=r, adv=a))
    assert sil.full and not sil.add(SILEntry([], reward=1.0, adv=1.0))
    kept = dual_filter(sil.drain(), base.p50())
    assert [(e.reward, round(a, 6)) for e, a in kept] == [(1.1, 0.8), (1.0, 0.7)]  # R = 0.2 < P50 is out
    assert sil.entries == []


def test_spear_intrinsic_reward_eq6():
    from agentrl.recipes.spear import intrinsic_reward

    ep = _episode(won=False)
    for t in ep.turns:
        t.info["valid_actions"] = 1
    assert intrinsic_reward(ep, mu=1.0) == pytest.approx(-1.0 + 0.3 + 0.1)
    assert intrinsic_reward(ep, mu=0.5) == pytest.approx(-1.0 + 0.15 + 0.1)
    ep.won = True
    ep.turns[0].format_ok = False
    assert intrinsic_reward(ep, mu=0.0) == pytest.approx(1.0)
    for t in ep.turns:
        t.info["valid_actions"] = 5  # n counts tool-call turns (3 here), not the 15 actions
    assert intrinsic_reward(ep, mu=1.0) == pytest.approx(1.0 + 0.3)
    ep.turns = ep.turns * 4  # 12 tool-call turns: min(1, 0.1 n) caps at 1
    assert intrinsic_reward(ep, mu=1.0) == pytest.approx(2.0)


def test_spear_covariance_is_centred_on_the_group_with_a_budget_per_trajectory():
    """Eq. 19-21 by hand: trajectory A (R 1, its group's mean R 0.5, mean log-prob -1) has two turns of two
    tokens; trajectory B (R 1, group mean 1) has centred advantage 0, so no covariance and nothing clipped."""
    from agentrl.learner.batch import Sample
    from agentrl.recipes.spear import covariance_bounds, covariance_clip, sil_covariances

    a1 = Sample([1, 2, 3], [0, 1, 1], [0.0, -0.5, -2.0], [0.0, 1.0, 1.0])
    a2 = Sample([1, 2, 3], [0, 1, 1], [0.0, 0.0, -1.0], [0.0, 1.0, 1.0])
    b = Sample([1, 2], [0, 1], [0.0, -3.0], [0.0, 1.0])
    covs = sil_covariances([([a1, a2], 1.0 - 0.5, -1.0), ([b], 1.0 - 1.0, -1.0)])
    # (lp + 1) x 0.5 over A's four tokens in order; 0 for B
    assert covs[0].tolist() == pytest.approx([0.25, -0.5, 0.5, 0.0]) and covs[1].tolist() == [0.0]
    gen = torch.Generator().manual_seed(0)
    chosen = covariance_clip(covs, (0.1, 1.0), ratio=0.25, generator=gen)
    assert len(chosen[0]) == 1 and chosen[0][0] in (0, 2) and chosen[1] == []  # budget round(0.25 x 4) = 1
    assert covariance_clip(covs, (0.1, 1.0), ratio=1.0, generator=gen)[0] == [0, 2]  # never outside the band
    # bounds from the first batch (appendix A.12): the mean of the top 40% and of the top 20% of the tokens
    assert covariance_bounds(covs, low_top=0.4, high_top=0.2) == pytest.approx((0.375, 0.5))


def test_spear_covariance_bounds_come_from_the_first_steps_rollouts():
    """Appendix A.12: the bounds are set once, from the initial policy's rollouts at the first step (every
    generated token, centred on its group), not from a first self-imitation batch of a few tokens."""
    from agentrl.recipes.spear import first_step_bounds

    def ep(group, lps, won):
        t = Turn([1], [2] * len(lps), lps, "", ["a"], True, "o", float(won), True)
        return Episode("sokoban", "train/00001", 0, group_id=group, turns=[t], won=won)

    # group g: log-probs mean -1, rewards 1 and 0 (mean 0.5); group h is all-failed: covariance 0
    eps = [ep("g", [0.0, -1.0], True), ep("g", [-2.0, -1.0], False), ep("h", [-5.0], False), ep("h", [-1.0], False)]
    # covariances: (0+1)0.5, 0, (-2+1)(-0.5), 0, 0, 0 -> sorted 0.5, 0.5, 0, 0, 0, 0
    lb, ub = first_step_bounds(eps, lambda e: float(e.won))
    assert (lb, ub) == pytest.approx(((0.5 + 0.5) / 2, 0.5 + 1e-6))  # top 20% of 6 = 2 tokens; top 0.02% = 1
    assert first_step_bounds([], lambda e: 0.0) is None


def test_crps_step_metrics_cover_every_dynamic_sampling_round():
    from types import SimpleNamespace

    from agentrl.config_loader import load_config
    from agentrl.recipes.crps import CRPS
    from agentrl.types import Episode, Turn

    def ep(group, task, won):
        t = Turn([1], [2], [0.0], "", ["go north"], True, "o", float(won), True, fingerprints=["f1"])
        return Episode("sokoban", task, 0, group_id=group, turns=[t], won=won, initial_fingerprint="f0")

    recipe = CRPS(load_config("crps", env="sokoban"))
    trainer = SimpleNamespace(step=0)
    recipe.after_rollout(trainer, [ep("a", "train/00001", False), ep("a", "train/00001", False)])  # round 1
    recipe.after_rollout(trainer, [ep("b", "train/00002", True), ep("b", "train/00002", False)])  # round 2
    stats = recipe.end_step()  # what CRPS.collect hands on with its metrics
    # over both rounds: one all-zero group of two, 1 success in 4 rollouts, one buffer insertion (round 2)
    assert stats["fresh/all_zero_groups"] == 0.5 and stats["fresh/success"] == 0.25
    assert stats["buffer_inserted"] == 1.0 and stats["buffer_size"] == 1.0 and stats["replay_groups"] == 0.0
    after = recipe.end_step()  # the next step starts from nothing
    assert "fresh/success" not in after


def test_spear_self_imitation_rows_weigh_like_on_policy_rows_per_turn():
    from types import SimpleNamespace

    import torch

    from agentrl.buffers.sil import SILEntry
    from agentrl.config_loader import load_config
    from agentrl.learner.batch import turn_sample
    from agentrl.recipes.spear import SPEAR

    # turn level, turn_weight: episode; no covariance clipping here (the test above covers it)
    recipe = SPEAR(load_config("spear", env="sokoban", overrides=["extra.cov_ratio=0"]))
    rows = [turn_sample([1, 2], [3, 4], [0.0, 0.0], 0.0), turn_sample([1, 2, 3, 4, 5], [6], [0.0], 0.0)]
    engine = SimpleNamespace(pad_id=0, logprobs=lambda b, t=1.0: torch.zeros_like(b.old_logprobs))
    trainer = SimpleNamespace(engine=engine, rng=__import__("random").Random(0))
    out = recipe._sil_samples(trainer, [(SILEntry(rows, 1.0, 0.8), 0.6)], gamma=1.0)
    # a two-turn trajectory with recalibrated advantage 0.6: 0.3 on every target token of each turn
    assert [[a for a, m in zip(s.advantages, s.loss_mask) if m] for s in out] == [[0.3, 0.3], [0.3]]


def test_gigpo_without_std_is_an_estimator():
    import torch

    from agentrl.algos.advantages import ESTIMATORS, AdvantageInput

    x = AdvantageInput(torch.tensor([1.0, 0.0]), ["g", "g"], [[0.0, 0.0, 1.0], [0.0, 0.0]],
                       [[0.0, 0.0, 1.0], [0.0, 0.0]], anchors=[["s0", "s1", "s2"], ["s1", "s3"]], gamma=1.0)
    out = ESTIMATORS.get("gigpo_dr")(x)  # the by-hand case of test_gigpo_step_groups_by_hand, no std
    assert out.per_turn[0] == pytest.approx([0.5, 1.0, 0.5]) and out.per_turn[1] == pytest.approx([-1.0, -0.5])


def test_crps_expert_entries_for_unsolved_instances_hand_over_before_the_goal():
    """extra.expert_per_step: a fresh all-zero group's instance gets the env expert's solution as a buffer
    entry whose first replay starts expert_k0 turns before the end (the restored prefix reaches the
    recorded state and the remaining expert action wins); at most expert_per_step instances a step,
    an instance already buffered is not replayed by the expert again, and solved groups get none."""
    from types import SimpleNamespace

    from agentrl.config_loader import load_config
    from agentrl.envs import registry
    from agentrl.recipes.crps import CRPS
    from agentrl.types import Episode, Turn

    def ep(group, task, seed, won):
        t = Turn([1], [2], [0.0], "", ["Left"], True, "o", float(won), True, fingerprints=["f1"])
        return Episode("sokoban", task, seed, group_id=group, turns=[t], won=won, initial_fingerprint="f0")

    recipe = CRPS(load_config("crps", env="sokoban", overrides=["extra.expert_per_step=1"]))
    trainer = SimpleNamespace(step=3)
    a, b = ("train/00002", 5), ("train/00004", 5)  # the expert solves both in <= 6 moves
    recipe.after_rollout(trainer, [ep("a", *a, False), ep("a", *a, False), ep("b", *b, False)])
    entry = recipe.buffer.entries["train/00002:5"]
    assert len(recipe.buffer) == 1 and recipe.buffer.counts["expert"] == 1  # the step's budget: one instance
    assert entry.T == 6 and entry.ctrl.k == 1 and entry.acc == 0.0 and entry.inserted_at == 3
    t0, t0_steps = entry.handover(entry.ctrl.k)
    assert (t0, t0_steps) == (5, 5)
    env = registry.make("sokoban")
    obs, info = env.reset(*a)
    for action in entry.trace.actions[:t0_steps]:
        obs, _, _, _, info = env.step(action)
    assert info["fingerprint"] == entry.trace.fingerprints[t0_steps] and obs == entry.observations[t0]
    *_, info = env.step(entry.trace.actions[t0_steps])
    assert info["won"]
    env.close()
    stats = recipe.end_step()
    assert stats["buffer_expert"] == 1.0
    solved = ("train/00001", 5)
    recipe.after_rollout(trainer, [ep("c", *a, False), ep("d", *solved, True), ep("d", *solved, False)])
    assert recipe.buffer.counts["expert"] == 1  # a is buffered already; d was solved (a policy entry instead)
    assert set(recipe.buffer.entries) == {"train/00002:5", "train/00001:5"}
    recipe.close()  # the expert's env is the recipe's own
    assert recipe._expert_env is None
