"""agentrl envs through the Gymnasium API: gymnasium.make, the env checker, task ids and info keys."""
import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import agentrl.envs  # noqa: F401  (registers the agentrl/* gymnasium ids)
from agentrl.envs.base import EnvError
from agentrl.envs.gymnasium_api import gym_id
from agentrl.envs.registry import fast_names

FAST = [gym_id(n) for n in fast_names()] + ["agentrl/WebShop-v0"]
ENGINES = ["agentrl/TextWorld-v0", "agentrl/ALFWorld-v0", "agentrl/ScienceWorld-v0"]


def test_every_registered_env_has_a_gymnasium_id():
    from agentrl.envs import names

    assert {gym_id(n) for n in names()} == set(FAST + ENGINES)
    assert all(i in gym.registry for i in FAST + ENGINES)


# ScienceWorld's checker takes minutes (its Java engine); test_text_games and test_fuzz step it in make test
@pytest.mark.parametrize("gid", FAST + [pytest.param(g, marks=[pytest.mark.slow, pytest.mark.timeout(600)] + (
    [pytest.mark.extended] if "ScienceWorld" in g else [])) for g in ENGINES])
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


def test_a_gymnasium_text_env_is_an_agentrl_env_with_replay_restore():
    import tests.gym_text_envs  # noqa: F401  (registers the outside-suite stand-ins)
    from agentrl.envs import make
    from agentrl.envs.replay import play, replay

    env = make("gymnasium:agentrl_test/Countdown-v0", instruction="Count down to zero.")
    try:
        assert env.prompt_spec().instruction == "Count down to zero." and len(env.tasks("test")) == 1000
        obs, info = env.reset("train/00007", 0)
        start = int(obs.split()[3].rstrip("."))
        trace, observations, infos = play(env, "train/00007", 0,
                                          lambda k: str(start - 1 - k) if k < start else None)
        assert infos[-1]["won"] and trace.fingerprints[-1] == infos[-1]["fingerprint"]
        obs, info = replay(env, trace, 2)  # seeded reset + 2 actions, fingerprints checked
        assert obs == observations[2]
        assert make("gymnasium:agentrl_test/Countdown-v0").reset("test/00007", 0)[0] != "" and \
            {t.task_id for t in env.tasks("train")}.isdisjoint({t.task_id for t in env.tasks("test")})
        env.check()
    finally:
        env.close()
    noisy = make("gymnasium:agentrl_test/NoisyCountdown-v0")
    with pytest.raises(EnvError, match="is not deterministic under replay"):
        noisy.check(actions=("9", "8", "7", "6", "5", "4"))
    with pytest.raises(EnvError, match="returned a list observation, not text"):
        make("gymnasium:agentrl_test/Pixels-v0").reset("train/00000", 0)
    with pytest.raises(EnvError, match="gymnasium env 'agentrl_test/Nope-v0' cannot be made"):
        make("gymnasium:agentrl_test/Nope-v0")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_recipe_trains_on_a_gymnasium_env_named_in_its_config(tiny_model_dir, tmp_path):
    import json

    from agentrl.config_loader import load_config
    from tests.test_trainer import run, small

    # "module:id" makes gymnasium import the module that registers the id (how a user brings their own env)
    cfg = load_config("grpo", env="gymnasium:tests.gym_text_envs:agentrl_test/Countdown-v0",
                      overrides=small(tmp_path, tiny_model_dir, "sft.enabled=false", "rollout.prompt=compact",
                                      "env_kwargs={instruction: 'Count down to zero, one number per turn.'}"))
    trainer, final = run(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/success" in final and "valid_format" in rows[1]
