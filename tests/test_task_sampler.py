"""rollout.task_sampler: the learnability frontier (which levels enter and leave it, what a round draws
from it, that a checkpoint carries it) and the uniform default left as it was."""
import random

import pytest

from agentrl.config import ConfigError, RolloutCfg

from agentrl.config_loader import load_config
from agentrl.curriculum.task_sampler import LearnabilityTasks
from agentrl.types import Episode


class FakeTrainer:
    """What a sampler reads from the trainer: its step, its RNG and its uniform draw."""

    def __init__(self):
        self.step, self.rng, self.fresh = 0, random.Random(0), 0

    def sample_tasks(self, n):
        self.fresh += n
        return [(f"train/{9000 + self.fresh - n + i}", 7) for i in range(n)]


def group(task, wins, gid=None, start_index=0, seed=0):
    return [Episode("sokoban", task, seed, gid or f"g-{task}", won=w, start_index=start_index) for w in wins]


def reward(e):
    return float(e.won)


def sampler(share=0.5, size=3):
    return LearnabilityTasks(RolloutCfg(frontier_share=share, frontier_size=size))


def test_mixed_groups_enter_the_frontier_and_leave_it_when_all_fail_or_all_succeed():
    s = sampler(size=3)
    counts = s.observe(group("a", [1, 0, 0, 0]) + group("b", [0, 0, 0, 0]) + group("c", [1, 1, 1, 1])
                       + group("d", [1, 1, 0, 0]) + group("e", [1], gid="lone")
                       + group("f", [1, 0], start_index=2), reward)  # a suffix replay says nothing of the level
    assert s.frontier == {("a", 0): 0.1875, ("d", 0): 0.25}  # p(1-p) of the last group
    assert counts == dict(frontier_groups=0, frontier_informative_groups=0, fresh_groups=4,
                          fresh_informative_groups=2)
    s.observe(group("g", [1, 0]) + group("h", [0, 1]), reward)
    assert list(s.frontier) == [("d", 0), ("g", 0), ("h", 0)]  # the size cap drops the oldest
    s.observe(group("d", [1, 1]) + group("g", [0, 1, 1, 1]), reward)
    assert list(s.frontier) == [("h", 0), ("g", 0)]  # d was learned; g's new reading makes it the newest
    assert s.frontier[("g", 0)] == 0.1875 and s.gauges() == dict(frontier_levels=2.0)


def test_a_round_draws_its_share_from_the_frontier_once_per_step_and_the_rest_fresh():
    s, t = sampler(share=0.5, size=10), FakeTrainer()
    s.sample(t, 4)
    assert t.fresh == 4  # an empty frontier: all fresh
    s.observe(group("x", [1, 0]) + group("y", [0, 1]) + group("z", [1, 0, 0, 0]), reward)
    first = s.sample(t, 4)
    assert t.fresh == 6 and len(set(first[:2])) == 2 and set(first[:2]) <= set(s.frontier)
    second = s.sample(t, 4)  # a later round of the same step: the level left over, then fresh ones
    assert set(first[:2] + second[:1]) == set(s.frontier) and t.fresh == 9
    learned = second[0]
    counts = s.observe(group(learned[0], [1, 1], seed=learned[1])
                       + [e for k in second[1:] for e in group(k[0], [0, 0], seed=k[1])], reward)
    assert counts == dict(frontier_groups=1, frontier_informative_groups=0, fresh_groups=3,
                          fresh_informative_groups=0)
    assert set(s.frontier) == set(first[:2])  # the learned level left, the all-fail fresh ones never came in
    t.step = 1  # a new step may draw the levels again
    assert set(s.sample(t, 4)[:2]) == set(first[:2])


def test_draws_follow_the_variance():
    s, t = sampler(share=0.25, size=10), FakeTrainer()
    s.frontier = {("rare", 0): 0.01, ("often", 0): 0.25}
    picks = []
    for step in range(2000):
        t.step = step
        picks.append(s.sample(t, 4)[0][0])
    assert 0.93 < picks.count("often") / len(picks) < 0.99  # 0.25 / 0.26


def test_a_checkpoint_carries_the_frontier(tiny_model_dir, tmp_path):
    """Through the trainer and the base recipe: a mixed group of round 1 is drawn again in step 2, the
    frontier's counts reach the step's metrics, and a resumed trainer holds the saved frontier."""
    from agentrl import Trainer
    from tests.test_trainer import small

    over = small(tmp_path, tiny_model_dir, "rollout.task_sampler=learnability", "rollout.frontier_share=0.5",
                 "sft.enabled=false", "eval.tasks=0", "rollout.fill_groups=0")
    cfg = load_config("grpo", env="sokoban", overrides=over)
    t = Trainer.from_config(cfg)
    try:
        rounds = []

        def fake_rollout(starts, **_):
            rounds.append([s.task_id for s in starts])
            # the first group of each round mixed, the second all-fail
            return [Episode("sokoban", s.task_id, s.seed, s.group_id, won=(i < 2 and i % 2 == 0))
                    for i, s in enumerate(starts)]

        t.rollout = fake_rollout
        _, stats = t.recipe.collect(t)
        assert stats["frontier_levels"] == 1.0 and stats["fresh_informative_groups"] == 1.0
        t.step = 1
        _, stats = t.recipe.collect(t)
        assert rounds[1][0] == rounds[0][0] and stats["frontier_groups"] == 1.0  # the mixed level again
        t.save_checkpoint()
        saved = dict(t.recipe.tasks.frontier)
    finally:
        t.close()
    t2 = Trainer.from_config(cfg)
    try:
        assert t2.load_checkpoint() and t2.recipe.tasks.frontier == saved and saved
    finally:
        t2.close()


def test_bad_sampler_settings_name_the_key():
    with pytest.raises(ConfigError, match="rollout.task_sampler.*allowed: learnability, uniform"):
        load_config("grpo", overrides=["rollout.task_sampler=hardest"])
    with pytest.raises(ConfigError, match="rollout.frontier_share"):
        load_config("grpo", overrides=["rollout.task_sampler=learnability", "rollout.frontier_share=1.5"])
    assert load_config("grpo", env="sokoban").rollout.task_sampler == "uniform"


def test_a_recipe_that_draws_its_own_tasks_refuses_another_sampler():
    """RRO, LEAFE and the staged recipes never feed the frontier: a learnability run of theirs would be
    uniform in all but name."""
    from agentrl import RECIPES

    for name in ("rro", "leafe", "rft"):  # refused when the config loads (Recipe.check_config)
        with pytest.raises(ConfigError, match=f"rollout.task_sampler: learnability.*{name} draws its tasks itself"):
            load_config(name, env="sokoban", overrides=["rollout.task_sampler=learnability"])
    for name in ("grpo", "crps", "spear"):
        cfg = load_config(name, env="sokoban", overrides=["rollout.task_sampler=learnability"])
        assert RECIPES.get(cfg.method)(cfg).tasks.share == 0.5
