"""Paper recipes end to end on CPU with a tiny model: CRPS (with a forced suffix replay), exp_replay,
SPEAR on each base, Dr.BoT; recipe-specific config errors."""
import json

import pytest

from agentrl.config import ConfigError, load_config
from tests.test_trainer import run, small

RECIPES = ["crps", "exp_replay", "dr_bot", "spear", "spear_dr_bot", "spear_gigpo"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", RECIPES)
def test_paper_recipe_runs_end_to_end(recipe, tiny_model_dir, tmp_path):
    extra = ["extra.buffer_size=2", "extra.warmup_steps=1"] if recipe.startswith("spear") else []
    cfg = load_config(recipe, env="sokoban", overrides=small(tmp_path, tiny_model_dir, *extra))
    trainer, final = run(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/success" in final
    if recipe in ("crps", "exp_replay"):
        assert "buffer_size" in rows[1] and "fresh/all_zero_groups" in rows[1]
    if recipe.startswith("spear"):
        assert rows[1]["sil_gamma"] == 1.0 and "baseline_p50" in rows[1] and "tool_mu" in rows[1]


def _expert_entry(env_name, task_id, seed=5):
    """A successful fresh episode of the env's expert, as the rollout engine would record it."""
    from agentrl.types import Episode, Turn
    from envs import registry
    from envs.replay import expert_episode

    env = registry.make(env_name)
    trace, observations, infos = expert_episode(env, task_id, seed=seed)
    assert infos[-1]["won"]
    turns = [Turn([1], [2], [-0.1], a, [a], True, observations[i + 1], 0.0, i == len(trace.actions) - 1,
                  fingerprints=[trace.fingerprints[i + 1]]) for i, a in enumerate(trace.actions)]
    ep = Episode(env_name, task_id, seed, "g", instruction=env.instruction(), initial_observation=observations[0],
                 initial_fingerprint=trace.fingerprints[0], turns=turns, won=True)
    env.close()
    return ep, observations


@pytest.mark.timeout(300)
def test_crps_suffix_replay_restores_the_recorded_state_and_trains_only_on_the_suffix(tiny_model_dir, tmp_path):
    import recipes  # noqa: F401
    from agentrl.curriculum.suffix_k import KController
    from agentrl.recipe import RECIPES
    from agentrl.trainer import Trainer

    cfg = load_config("crps", env="sokoban", overrides=small(tmp_path, tiny_model_dir, "extra.p_replay=1.0",
                                                             "rollout.max_turns=6"))
    recipe = RECIPES.get("crps")(cfg)
    trainer = Trainer(cfg, recipe)
    try:
        task = trainer.task_ids("train")[0]
        ep, observations = _expert_entry("sokoban", task)
        T = len(ep.turns)
        assert T >= 2
        recipe.buffer.offer(ep, 0.25, KController(1, 1, T))  # k = 1: hand over before the last action
        starts = recipe.starts(trainer)
        assert len(starts) == cfg.rollout.groups * cfg.rollout.group_size and all(s.trace for s in starts)
        assert {s.t0 for s in starts} == {T - 1} and all(s.max_turns == max(1, 6 - (T - 1)) for s in starts)
        episodes = trainer.rollout(starts)
        for e in episodes:
            assert e.start_index == T - 1 and e.prefix_actions == ep.env_actions[:T - 1]
            assert e.initial_observation == observations[T - 1]  # the restored state, exactly
        recipe.after_rollout(trainer, episodes)
        samples, _ = recipe.make_batch(trainer, episodes)
        prefix_text = ep.env_actions[0]
        for s in samples:  # the prefix is prompt context: no loss target outside the policy's tokens
            targets = [i for i, m in zip(s.ids, s.loss_mask) if m]
            turn = episodes[s.meta["episode"]].turns[s.meta["turn"]]
            assert targets == turn.gen_ids
        text = trainer.tokenizer.decode(samples[0].ids)
        assert prefix_text in text  # ... but it is in the prompt's history window
        entry = recipe.buffer.entries[f"{task}:5"]
        assert entry.replays == cfg.rollout.groups and entry.ctrl.rho_hat is not None  # one per replay group
    finally:
        trainer.close()


def test_recipe_extra_keys_are_validated():
    with pytest.raises(ConfigError, match=r"unknown key 'extra.p_replays'; allowed: .*p_replay"):
        load_config("crps", overrides=["extra.p_replays=0.5"])
    with pytest.raises(ConfigError, match=r"bad value for 'extra.dynamic_k': 'maybe'; allowed: true or false"):
        load_config("crps", overrides=["extra.dynamic_k=maybe"])
    with pytest.raises(ConfigError, match=r"unknown key 'extra.p_replay': recipe method 'grpo' takes no extra keys"):
        load_config("grpo", overrides=["extra.p_replay=0.5"])
    with pytest.raises(ConfigError, match=r"unknown key 'extra.warmup'; allowed: .*warmup_steps"):
        load_config("spear_dr_bot", overrides=["extra.warmup=3"])
    cfg = load_config("spear_dr_bot")
    assert cfg.method == "spear" and cfg.algo.estimator == "dr_grpo" and cfg.algo.eps_high == 0.28
    assert load_config("exp_replay").extra["from_start"] is True
