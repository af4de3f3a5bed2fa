"""Sokoban, FrozenLake and the bandit: rules, rewards, stochastic replay, expert and restore checks."""
import collections

import pytest

from agentrl.envs import make, replay
from agentrl.envs.check import check_env
from agentrl.envs.replay import record
from agentrl.envs.sokoban import Level, generate_level


@pytest.mark.parametrize("name,min_success", [("sokoban", 1.0), ("sokoban-large", 1.0), ("sokoban-newvocab", 1.0),
                                              ("frozenlake", 0.6), ("bandit", 1.0), ("bandit-reversed", 1.0)])
def test_expert_and_restore(name, min_success):
    rep = check_env(name, n_expert=20, n_replay=10, seed=3)
    assert rep.ok, rep.summary()
    assert rep.success_rate >= min_success, rep.summary()
    assert rep.replay_checked == 10 and rep.tamper_checked == 10 and rep.snapshot_checked == 10


def _corridor_env():
    """#######   player P at col 1, box at col 2, target at col 3, second target at col 5."""
    env = make("sokoban", dim=7)
    env.reset("train/00000")
    walls = {(r, c) for r in range(7) for c in range(7) if r != 3 or c in (0, 6)}
    env.level = Level(walls, frozenset({(3, 3), (3, 5)}), (3, 1), frozenset({(3, 2), (3, 4)}), 7)
    env.player, env.boxes, env.num_boxes = (3, 1), frozenset({(3, 2), (3, 4)}), 2
    return env


def test_sokoban_rewards_by_hand():
    env = _corridor_env()
    assert env.render().split("\n")[3] == "# P X O X O #"
    _, r, term, _, info = env.step("Left")  # into the wall: no move, -0.1
    assert r == pytest.approx(-0.1) and not term and env.player == (3, 1)
    _, r, term, _, info = env.step("Right")  # box (3,2) -> (3,3), a target: -0.1 + 1
    assert r == pytest.approx(0.9) and info["score"] == 0.5 and not term
    _, r, term, _, info = env.step("Right")  # box blocked by the other box: no move, -0.1
    assert r == pytest.approx(-0.1) and env.player == (3, 2) and info["score"] == 0.5


def test_sokoban_push_off_target_and_solve():
    env = make("sokoban", dim=7)
    env.reset("train/00000")
    walls = {(r, c) for r in range(7) for c in range(7) if r != 3 or c in (0, 6)}
    env.level = Level(walls, frozenset({(3, 3)}), (3, 1), frozenset({(3, 3)}), 7)
    env.player, env.boxes = (3, 2), frozenset({(3, 3)})
    _, r, term, _, _ = env.step("Right")  # box leaves its target: -0.1 - 1
    assert r == pytest.approx(-1.1) and not term
    env.player, env.boxes = (3, 1), frozenset({(3, 2)})
    _, r, term, _, info = env.step("Right")  # onto the target, all boxes placed: -0.1 + 1 + 10
    assert r == pytest.approx(10.9) and term and info["won"]


def test_sokoban_progress_is_the_share_of_box_distance_closed():
    env = make("sokoban", dim=7)
    env.reset("train/00000")
    walls = {(r, c) for r in range(7) for c in range(7) if r != 3 or c in (0, 6)}
    env.level = Level(walls, frozenset({(3, 5)}), (3, 1), frozenset({(3, 2)}), 7)  # box 3 cells from its target
    env.player, env.boxes = (3, 1), env.level.boxes
    _, _, _, _, info = env.step("Right")
    assert info["progress"] == pytest.approx(1 / 3) and info["score"] == 0.0
    _, _, _, _, info = env.step("Right")
    assert info["progress"] == pytest.approx(2 / 3)
    env.player, env.boxes = (3, 3), frozenset({(3, 2)})  # from its right, push it back past the start
    _, _, _, _, info = env.step("Left")
    assert info["progress"] == 0.0  # further than at the start: no negative progress
    env.player, env.boxes = (3, 3), frozenset({(3, 4)})
    _, _, term, _, info = env.step("Right")
    assert term and info["progress"] == 1.0 and info["won"]


def test_sokoban_invalid_action_is_reported():
    env = make("sokoban")
    obs0, _ = env.reset("train/00001")
    obs, r, term, trunc, info = env.step("jump")
    assert obs == obs0 and r == pytest.approx(-0.1) and not info["action_is_valid"]


def test_sokoban_generation_is_deterministic_and_solvable():
    a, sol_a = generate_level(42, 6, 1, 10)
    b, sol_b = generate_level(42, 6, 1, 10)
    assert (a.walls, a.boxes, a.targets, a.player) == (b.walls, b.boxes, b.targets, b.player) and sol_a == sol_b
    assert a.solve(a.player, a.boxes) == sol_a and 2 <= len(sol_a) <= 10


def test_newvocab_uses_other_symbols():
    ob, _ = make("sokoban").reset("train/00004")
    on, _ = make("sokoban-newvocab").reset("train/00004")
    assert "#" in ob and "#" not in on and "W" in on
    assert ob.count("\n") == on.count("\n")


def test_frozenlake_is_slippery_and_replays_its_rng():
    env = make("frozenlake")
    # the same action from the same start lands in different cells under different seeds
    outcomes = set()
    for s in range(40):
        env.reset("train/00005", seed=s)
        outcomes.add(env.step("Right")[0])
    assert len(outcomes) > 1
    trace, observations = record(env, "train/00005", 17, ["Right", "Down", "Right", "Down"])
    obs, _ = replay(make("frozenlake"), trace)
    assert obs == observations[-1]
    assert "\x1b" not in obs and set(obs.replace(" ", "").replace("\n", "")) <= set("P_OGX√")


def test_frozenlake_reseed_gives_new_stream():
    env = make("frozenlake")
    trace, _ = record(env, "train/00002", 1, ["Down"])
    futures = set()
    for reseed in range(12):
        replay(env, trace, 1, reseed=reseed)
        futures.add(env.step("Right")[0] if not env.done else "ended")
    assert len(futures) > 1


def test_bandit_payoffs_and_reversal():
    env = make("bandit")
    task = env.tasks("train")[0].task_id
    rewards = collections.Counter()
    for s in range(2000):
        env.reset(task, seed=s)
        rewards[env.step(env.high_arm)[1]] += 1
    assert set(rewards) == {0.0, 1.0}
    assert 0.21 < rewards[1.0] / 2000 < 0.29
    env.reset(task, seed=0)
    low = [a for a in env.arms if a != env.high_arm][0]
    _, r, term, _, info = env.step(low.upper())  # case-insensitive
    assert r == 0.15 and term and not info["won"]
    rev = make("bandit-reversed")
    rev.reset(task)
    env.reset(task)
    assert rev.high_arm != env.high_arm and set(rev.arms) == set(env.arms)


def test_bandit_heldout_names():
    env = make("bandit")
    def names(split):
        return {n for t in env.tasks(split) for n in t.task_id.split("/")[1].split("-")[:2]}
    assert not names("train") & names("test")
