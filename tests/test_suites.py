"""Outside env suites (GEM, TextArena, reasoning-gym) through the Gymnasium adapter: rollouts, replay-prefix
restore, wins, and the process's random state left alone. Skipped where the `suites` extra is absent
(`make setup` installs it)."""
import json
import random

import numpy as np
import pytest

from agentrl.envs import make
from agentrl.envs.base import EnvError
from agentrl.envs.replay import play, replay


def _binary_search(env, fmt):
    """Guesses from the 'higher'/'lower' hints: a policy that wins, to check that wins are scored."""
    state = {"lo": 1, "hi": 10 if "easy" in env.gym_id else 20, "guess": None}

    def act(k):
        obs = env.last_obs.lower()
        if state["guess"] is not None:
            if "higher" in obs:
                state["lo"] = state["guess"] + 1
            elif "lower" in obs:
                state["hi"] = state["guess"] - 1
        state["guess"] = (state["lo"] + state["hi"]) // 2
        return fmt.format(state["guess"])
    return act


@pytest.mark.parametrize("name,fmt", [("gem:game:GuessTheNumber-v0-easy", "\\boxed{{{}}}"),
                                      ("textarena:GuessTheNumber-v0-raw", "[{}]")])
def test_a_suite_game_rolls_out_wins_and_restores_by_replay(name, fmt):
    pytest.importorskip(name.split(":")[0])
    env = make(name)
    try:
        random.seed(123)
        np.random.seed(123)
        expected = random.random(), float(np.random.random())
        random.seed(123)
        np.random.seed(123)
        trace, observations, infos = play(env, "train/00005", 0, _binary_search(env, fmt))
        # the suites seed the global generators at reset; the adapter keeps that to the env's own copy
        assert (random.random(), float(np.random.random())) == expected
        assert infos[-1]["won"] and len(trace.actions) >= 2
        obs, info = replay(env, trace, 1)  # seeded reset + the first action, fingerprints checked
        assert obs == observations[1] and info["fingerprint"] == trace.fingerprints[1]
        # another seed is another number to find: the task ids are the seeds
        other = make(name)
        _, _, infos2 = play(other, "valid/00005", 0, lambda k: fmt.format(1 + k) if k < 2 else None)
        assert not infos2[-1]["won"] or infos2[-1]["step"] <= 2
        other.close()
    finally:
        env.close()


def test_gem_wins_need_the_full_reward_and_its_sampler_is_a_demonstrator():
    pytest.importorskip("gem")
    env = make("gem:game:GuessTheNumber-v0-easy")
    try:
        env.reset("train/00000", 0)
        a = env.expert_action()
        assert a.startswith("\\boxed{") and 1 <= int(a[7:-1]) <= 10
        # four wrong guesses: GEM pays partial credit (closeness), which is a reward but not a win
        obs, reward, term, trunc, info = env.step("\\boxed{99}")
        while not env.done:
            obs, reward, term, trunc, info = env.step("\\boxed{1}" if env.steps % 2 else "\\boxed{2}")
        assert not info["won"]
    finally:
        env.close()


def test_a_reasoning_gym_dataset_is_a_one_turn_env_scored_by_the_dataset():
    pytest.importorskip("reasoning_gym")
    env = make("rg:basic_arithmetic")
    try:
        obs, info = env.reset("train/00003", 0)
        assert obs.startswith("Calculate") and env.max_steps == 1
        answer = str(eval(obs.removeprefix("Calculate ").rstrip(".")))  # the problem is plain arithmetic
        obs, reward, terminated, truncated, info = env.step(answer)
        assert (reward, terminated, info["won"]) == (1.0, True, True)
        env.reset("train/00003", 0)
        assert env.step("not a number")[1] == 0.0
        assert make("rg:basic_arithmetic").reset("test/00003", 0)[0] != env.reset("train/00003", 0)[0]
    finally:
        env.close()


def test_suite_errors_are_one_line_naming_the_env():
    pytest.importorskip("gem")
    with pytest.raises(EnvError, match="env 'gem:game:NoSuchGame-v0' cannot be made"):
        make("gem:game:NoSuchGame-v0")
    # an id whose data is a download away (NLTK's word list): one line, whatever the package printed
    nltk = pytest.importorskip("nltk")
    pytest.importorskip("textarena")
    try:
        nltk.data.find("corpora/words")
    except LookupError:
        with pytest.raises(EnvError, match="env 'textarena:Wordle-v0-raw' cannot be made") as e:
            make("textarena:Wordle-v0-raw")
        assert "\n" not in str(e.value)
    with pytest.raises(EnvError, match="expert 'sample' needs an env with sample_action"):
        make("rg:basic_arithmetic", expert="sample")


def test_a_missing_suite_package_is_a_one_line_error_saying_what_to_install(monkeypatch):
    import importlib

    real = importlib.import_module

    def without_gem(name, *a, **k):
        if name == "gem" or name.startswith("gem."):
            raise ImportError("No module named 'gem'")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", without_gem)
    with pytest.raises(EnvError, match=r"env 'gem:game:GuessTheNumber-v0-easy' needs the gem-llm package: "
                                       r"pip install -e '\.\[suites\]'"):
        make("gem:game:GuessTheNumber-v0-easy")


def test_envs_list_shows_the_suites_with_their_restore_mode(capsys):
    from agentrl.cli import main

    assert main(["envs", "list", "--json"]) == 0
    rows = {r["env"]: r for r in json.loads(capsys.readouterr().out)}
    for suite in ("gymnasium", "gem", "textarena", "rg"):
        assert f"{suite}:<id>" in rows
    assert rows["sokoban"]["restore"] == "snapshot, replay"
    pytest.importorskip("gem")
    assert rows["gem:<id>"]["restore"] == "replay" and "GuessTheNumber" in rows["gem:<id>"]["description"]
    assert main(["envs", "list", "--suite", "gem"]) == 0
    assert "gem:game:GuessTheNumber-v0-easy" in capsys.readouterr().out.split()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grpo_trains_on_a_gem_game_warm_started_from_its_sampler(tiny_model_dir, tmp_path):
    pytest.importorskip("gem")
    from agentrl.config_loader import load_config
    from tests.test_trainer import run, small

    cfg = load_config("grpo", env="gem:game:GuessTheNumber-v0-easy",
                      overrides=small(tmp_path, tiny_model_dir, "sft.demos=16", "sft.epochs=1",
                                      "rollout.max_turns=4", "algo.reward=env_return"))
    trainer, final = run(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/success" in final and rows[1]["generated_tokens"] > 0
