"""Paper recipes end to end on CPU with a tiny model: CRPS (with a forced suffix replay), exp_replay,
SPEAR on each base, Dr.BoT; recipe-specific config errors."""
import json

import pytest

from agentrl.config import ConfigError

from agentrl.config_loader import load_config
from tests.test_trainer import run, small

RECIPES = ["crps", "exp_replay", "dr_bot", "spear", "spear_dr_bot", "spear_gigpo"]


@pytest.mark.slow
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
    from agentrl.envs import registry
    from agentrl.envs.replay import expert_episode

    env = registry.make(env_name)
    trace, observations, infos = expert_episode(env, task_id, seed=seed)
    assert infos[-1]["won"]
    turns = [Turn([1], [2], [-0.1], a, [a], True, observations[i + 1], 0.0, i == len(trace.actions) - 1,
                  fingerprints=[trace.fingerprints[i + 1]]) for i, a in enumerate(trace.actions)]
    ep = Episode(env_name, task_id, seed, "g", instruction=env.instruction(), initial_observation=observations[0],
                 initial_fingerprint=trace.fingerprints[0], turns=turns, won=True)
    env.close()
    return ep, observations


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_crps_suffix_replay_restores_the_recorded_state_and_trains_only_on_the_suffix(tiny_model_dir, tmp_path):
    from agentrl import Trainer
    from agentrl.curriculum.suffix_k import KController

    cfg = load_config("crps", env="sokoban", overrides=small(tmp_path, tiny_model_dir, "extra.p_replay=1.0",
                                                             "rollout.max_turns=6"))
    trainer = Trainer.from_config(cfg)
    recipe = trainer.recipe
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
        for s in samples:  # the prefix is prompt context: no loss target outside the policy's tokens
            targets = [i for i, m in zip(s.ids, s.loss_mask) if m]
            turn = episodes[s.meta["episode"]].turns[s.meta["turn"]]
            assert targets == turn.gen_ids
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
    from agentrl.recipe import RECIPES
    with pytest.raises(ConfigError, match=r"bad value for 'extra.when_full': 'drop'; allowed: evict_oldest, refuse"):
        RECIPES.get("crps")(load_config("crps", overrides=["extra.when_full=drop"]))
    cfg = load_config("spear_dr_bot")
    assert cfg.method == "spear" and cfg.algo.estimator == "dr_grpo" and cfg.algo.eps_high == 0.28
    assert load_config("exp_replay").extra["from_start"] is True


# ----- LEAFE, early_exp, RRO, IPR ------------------------------------------------------------------
OFFLINE = ["leafe", "early_exp", "rro", "ipr"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", OFFLINE)
def test_offline_recipe_runs_end_to_end(recipe, tiny_model_dir, tmp_path):
    extra = {"leafe": ["extra.tasks=2", "extra.budget=3", "extra.period=1", "extra.reflect_tokens=8", "eval.samples=2"],
             "early_exp": ["extra.tasks=2", "extra.rollouts=2", "eval.samples=2"],
             "rro": ["extra.tasks=2", "extra.mc_rollouts=2", "extra.max_candidates=2"],
             "ipr": ["extra.tasks=2", "extra.mc_rollouts=2", "extra.max_candidates=2"]}[recipe]
    steps = 2 if recipe == "early_exp" else 1
    cfg = load_config(recipe, env="sokoban", overrides=small(tmp_path, tiny_model_dir, f"trainer.steps={steps}",
                                                               *extra))
    trainer, final = run(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps + 1)) and "eval/pass@1" in final
    if recipe == "early_exp":  # the world-model SFT, then a GRPO step
        assert "iwm_samples" in rows[1] and "iwm_samples" not in rows[2] and "all_zero_groups" in rows[2]
    if recipe == "leafe":
        assert rows[1]["leafe_branches"] >= 2 and rows[1]["leafe_reflections"] >= 1
        assert "eval/pass@2" in final
    if recipe in ("rro", "ipr"):
        assert rows[1]["candidates_per_step"] >= 1
        if recipe == "ipr":  # K candidates at every expert step, the three terms fitted
            assert rows[1]["candidates_per_step"] == 2 and rows[1]["ipr_expert_trajectories"] >= 1
            assert "outcome_dpo_pairs" in rows[1] and "dpo_pairs" in rows[1] and "sft_loss_first" in rows[1]


def test_rro_stopping_rule_and_pair_selection_on_scripted_rewards():
    from agentrl.recipes.rro import Candidate, select_pair, should_stop

    c = lambda r: Candidate(turn=None, reward=r, ended=False)  # noqa: E731
    cands = []
    for r in [0.2, 0.4, 0.6]:  # previous step's reward 0.5: the third candidate rises to it
        cands.append(c(r))
        if should_stop(cands, 0.5, max_candidates=5, fixed=False):
            break
    assert [x.reward for x in cands] == [0.2, 0.4, 0.6]
    assert should_stop([c(0.5)], 0.5, 5, False)  # >= counts as rising
    assert should_stop([c(0.0)] * 3, 0.5, 3, False)  # the cap
    assert not should_stop([c(0.9)], 0.5, 3, True) and should_stop([c(0.9)] * 3, 0.5, 3, True)  # IPR: always K
    chosen, rejected = select_pair(cands)
    assert chosen.reward == 0.6 and rejected.reward == 0.2
    assert select_pair([c(0.5), c(0.5)]) is None  # no preference without a difference


def test_dpo_loss_against_a_hand_computed_value():
    import math

    import torch

    from agentrl.algos.losses import dpo_loss

    loss, stats = dpo_loss(torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0]), torch.tensor([-1.5, -2.0]),
                           torch.tensor([-2.5, -1.5]), beta=0.5)
    m1 = 0.5 * ((-1.0 + 1.5) - (-3.0 + 2.5))  # 0.5
    m2 = 0.5 * ((-2.0 + 2.0) - (-1.0 + 1.5))  # -0.25
    expected = -(math.log(1 / (1 + math.exp(-m1))) + math.log(1 / (1 + math.exp(-m2)))) / 2
    assert float(loss) == pytest.approx(expected) and stats["accuracy"] == 0.5


def test_trajectory_dpo_sums_each_side_over_its_turns():
    """IPR's outcome-level pairs: a side's log-prob is the sum over its turns; shorter sides are padded with
    rows that hold no target, so every pair is one block of rows."""
    from types import SimpleNamespace

    import torch

    from agentrl.algos.losses import dpo_loss
    from agentrl.dpo import PreferencePair, TrajectoryPair, dpo_loss_fn, pair_rows
    from agentrl.learner.batch import collate

    traj = TrajectoryPair([([1, 2], [3]), ([1, 2, 3, 4], [5, 6])], [([1, 2], [7, 8])])
    step = PreferencePair([1], [2], [3])
    rows, width = pair_rows([traj, step])
    assert width == 2 and len(rows) == 8
    assert [sum(r.loss_mask) for r in rows] == [1, 2, 2, 0, 1, 0, 1, 0]  # chosen x2, rejected x2, per pair
    b = collate(rows, 0)
    logp = -0.5 * torch.ones_like(b.loss_mask, dtype=torch.float)  # every target token: log-prob -0.5
    b.ref_logprobs = -1.0 * b.loss_mask.float()
    loss, stats = dpo_loss_fn(0.1, width)(b, dict(logp=logp))
    # traj: chosen 3 tokens (-1.5 vs ref -3), rejected 2 (-1 vs -2); step: 1 token each side
    expected, _ = dpo_loss(torch.tensor([-1.5, -0.5]), torch.tensor([-1.0, -0.5]), torch.tensor([-3.0, -1.0]),
                           torch.tensor([-2.0, -1.0]), 0.1)
    assert float(loss) == pytest.approx(float(expected))
    assert SimpleNamespace(**stats).accuracy == 0.5  # the trajectory pair's margin is positive, the step's 0


def test_leafe_reflection_parsing_bfs_budget_and_depth():
    from collections import deque

    from agentrl.recipes.leafe import Branch, branch_queue_step, parse_reflection

    assert parse_reflection("<think>x</think><step>2</step><experience>push the box left first</experience>", 4) == \
        (2, "push the box left first")
    assert parse_reflection("<step>7</step><experience>x</experience>", 4) is None  # beyond the history
    assert parse_reflection("<step>1</step>", 4) is None  # no experience
    q = deque(Branch("t", 0, [], [], [], depth=d) for d in range(5))
    taken = []
    count = 0
    while (b := branch_queue_step(q, count, budget=3)) is not None:
        taken.append(b.depth)
        count += 1
    assert taken == [0, 1, 2] and len(q) == 2  # FIFO order, budget respected


def test_leafe_reflection_prompt_names_the_failure_and_the_loss_weighs_its_two_terms_apart():
    import torch

    from agentrl.algos.losses import sft_loss
    from agentrl.learner.batch import collate, turn_sample
    from agentrl.recipes.leafe import reflection_prompt
    from agentrl.sft import term_weighted

    steps = [("You see a box.", "Up"), ("Nothing happens.", "Up")]
    reason = "The step limit was reached before the task was completed."
    failed = reflection_prompt("Push the box.", steps, True, reason)
    assert "FAILURE REASON: The step limit was reached before the task was completed." in failed
    assert "Analyze your failed attempt" in failed
    assert "FAILURE REASON" not in reflection_prompt("Push the box.", steps, False)
    # L = L_cf + beta L_reh: 2 counterfactual tokens (NLL 1 and 3), 1 rehearsal token (NLL 4), beta = 0.5
    rows = [turn_sample([5], [6, 7], [0.0, 0.0], 1.0, dict(sft_term="counterfactual")),
            turn_sample([5], [8], [0.0], 1.0, dict(sft_term="rehearsal"))]
    b = collate(term_weighted(rows, dict(counterfactual=1.0, rehearsal=0.5)), pad_id=0)
    logp = torch.zeros_like(b.advantages)
    logp[0, 0], logp[0, 1], logp[1, 0] = -1.0, -3.0, -4.0
    assert sft_loss(logp * b.advantages, b.loss_mask).item() == pytest.approx((1 + 3) / 2 + 0.5 * 4)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_leafe_rollback_restores_the_recorded_observation_and_cf_excludes_experience(tiny_model_dir, tmp_path):
    """A branch restored to tau starts from exactly the observation recorded there; its counterfactual
    sample's prompt is the one without the experience, while the policy saw it with."""
    from agentrl import Trainer
    from agentrl.rollout.engine import Start
    from agentrl.envs.replay import Trace

    cfg = load_config("leafe", env="sokoban", overrides=small(tmp_path, tiny_model_dir, "rollout.max_turns=4"))
    trainer = Trainer.from_config(cfg)
    try:
        task = trainer.task_ids("train")[0]
        ep, observations = _expert_entry("sokoban", task)
        tau = 2
        acts = ep.env_actions[:tau - 1]
        fps = [ep.initial_fingerprint] + [t.fingerprints[0] for t in ep.turns[:tau - 1]]
        note = "Experience from an earlier attempt at this task: SECRET-HINT"
        start = Start(task, 5, "b", trace=Trace("sokoban", task, 5, acts, fps), t0=tau - 1,
                      history=[(observations[0], acts[0])], note=note, max_turns=2)
        out = trainer.rollout([start])[0]
        assert out.initial_observation == observations[tau - 1]
        first = out.turns[0]
        with_note = trainer.tokenizer.decode(first.prompt_ids)
        plain = trainer.tokenizer.decode(first.info["plain_prompt_ids"])
        assert "SECRET-HINT" in with_note and "SECRET-HINT" not in plain
        if len(out.turns) > 1:
            assert "SECRET-HINT" not in trainer.tokenizer.decode(out.turns[1].prompt_ids)  # only at tau
    finally:
        trainer.close()


@pytest.mark.parametrize("env", ["bandit", "sokoban", "frozenlake"])
def test_starpo_uses_ragens_settings(env):
    """RAGEN B.2: the env's own rewards, a -0.1 format penalty, think-then-answer, 5 turns, 5 actions a turn
    and 10 an episode, one sampling round, k1 KL in the reward only; evaluation on 256 levels at T = 0.5."""
    for recipe in ("starpo", "starpo_s"):
        c = load_config(recipe, env=env)
        r, a, e = c.rollout, c.algo, c.eval
        assert (a.reward, r.format_penalty, r.require_think, r.max_episode_actions) == ("env_return", -0.1, True, 10)
        assert r.max_turns == (1 if env == "bandit" else 5)  # the bandit is one pull
        assert r.fill_groups == 0 and (e.tasks, e.temperature) == (256, 0.5) and a.entropy_coef == 0.001
        assert a.kl == "none"
    assert load_config("starpo", env=env).algo.kl_reward_coef == 0.001
    assert load_config("starpo_s", env=env).algo.kl_reward_coef == 0.0


def test_the_episode_action_budget_truncates_the_episode(tiny_generator):
    from agentrl.envs.pool import InProcessEnvs
    from agentrl.rollout.engine import RolloutConfig, RolloutEngine, Start
    from agentrl.types import SamplingParams
    from tests.test_generation import ScriptedGenerator

    tok = tiny_generator.tokenizer
    # four moves a turn that never finish a level (left-right shuffles): only the budget ends the episode
    gen = ScriptedGenerator(tok, "<think></think><answer>Left || Right || Left || Right</answer>")
    cfg = RolloutConfig(max_turns=5, sampling=SamplingParams(max_new_tokens=32), max_episode_actions=10)
    ep = RolloutEngine(gen, tok, InProcessEnvs("sokoban", 1), "sokoban", cfg).run([Start("train/00002")])[0]
    assert [len(t.actions) for t in ep.turns] == [4, 4, 2] and ep.truncated
    cfg.max_episode_actions = 0
    ep = RolloutEngine(gen, tok, InProcessEnvs("sokoban", 1), "sokoban", cfg).run([Start("train/00002")])[0]
    assert [len(t.actions) for t in ep.turns] == [4] * 5


def test_think_demonstrations_pass_the_think_format():
    from agentrl.envs.base import PromptSpec
    from agentrl.rollout.parsing import parse_turn
    from agentrl.sft import answer_text

    spec = PromptSpec("", "", answer_tag="answer")
    assert parse_turn(answer_text(spec, "Up", think=True), "answer", require_think=True).valid
    assert not parse_turn(answer_text(spec, "Up"), "answer", require_think=True).valid


def test_starpo_ppo_is_token_level_gae_on_full_chat_episodes():
    c = load_config("starpo_ppo", env="sokoban")
    assert (c.algo.estimator, c.algo.level, c.rollout.chat_mode, c.algo.gamma, c.algo.lam) == \
        ("gae_token", "trajectory", "full", 1.0, 1.0)
    with pytest.raises(ConfigError, match="token-level GAE over whole multi-turn episodes"):
        load_config("starpo_ppo", env="sokoban", overrides=["rollout.chat_mode=window", "algo.level=turn"])
