"""agentrl envs through the Gymnasium API: gymnasium.make, the env checker, task ids and info keys."""
import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import agentrl.envs  # noqa: F401  (registers the agentrl/* gymnasium ids)
from agentrl.envs.base import EnvError

FAST = ["agentrl/Sokoban-v0", "agentrl/SokobanLarge-v0", "agentrl/SokobanNewVocab-v0", "agentrl/FrozenLake-v0",
        "agentrl/Bandit-v0", "agentrl/BanditReversed-v0", "agentrl/WebShop-v0"]
ENGINES = ["agentrl/TextWorld-v0", "agentrl/ALFWorld-v0", "agentrl/ScienceWorld-v0"]


def test_every_registered_env_has_a_gymnasium_id():
    from agentrl.envs import names
    from agentrl.envs.gymnasium_api import gym_id

    assert {gym_id(n) for n in names()} == set(FAST + ENGINES)
    assert all(i in gym.registry for i in FAST + ENGINES)


@pytest.mark.parametrize("gid", FAST + [pytest.param(g, marks=[pytest.mark.slow, pytest.mark.timeout(600)])
                                        for g in ENGINES])
def test_env_passes_the_gymnasium_checker(gid):
    env = gym.make(gid)
    try:
        check_env(env.unwrapped)
    finally:
        env.close()


def test_reset_picks_the_task_and_step_keeps_terminated_and_truncated_apart():
    env = gym.make("agentrl/Sokoban-v0")
    try:
        task = env.unwrapped.env.tasks("test")[3].task_id
        obs, info = env.reset(seed=7, options={"task_id": task})
        assert info["task_id"] == task and "admissible_actions" in info and info["instruction"]
        again, _ = env.reset(seed=7, options={"task_id": task})
        assert again == obs  # same task and seed, same start
        drawn = {env.reset(seed=s)[1]["task_id"] for s in range(5)}
        assert drawn <= {t.task_id for t in env.unwrapped.env.tasks("train")} and len(drawn) > 1
        _, reward, terminated, truncated, info = env.step("Up")
        assert isinstance(reward, float) and "fingerprint" in info and not (terminated and truncated)
        with pytest.raises(EnvError, match="unknown reset options"):
            env.reset(options={"level": 3})
    finally:
        env.close()
