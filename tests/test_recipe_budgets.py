"""The paper recipes carry their papers' values; the CPU demo's small ones sit in a `tiny` model overlay
(issue 73, items 3, 5 and 6)."""
from pathlib import Path

import pytest

from agentrl import load_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("recipe", ["starpo", "starpo_s", "starpo_ppo", "starpo_s_grpo"])
def test_starpo_has_ragens_budgets_and_the_tiny_model_its_own(recipe):
    paper = load_config(recipe, env="sokoban", model="smollm2")
    r, a = paper.rollout, paper.algo
    # RAGEN B.2 / its prompt: P = 8 x N = 16, 200 response tokens, E = 32 an update, one pass, actor lr 1e-6
    assert (r.groups, r.group_size, r.max_new_tokens) == (8, 16, 200)
    assert (a.mini_batch_samples, a.ppo_epochs, paper.optim.lr) == (32, 1, 1e-6)
    tiny = load_config(recipe, env="sokoban")
    assert (tiny.rollout.groups, tiny.rollout.group_size, tiny.rollout.max_new_tokens) == (16, 4, 32)
    if a.estimator == "gae_token":  # the critic at 10x the actor, as verl's defaults
        assert paper.optim.critic_lr == 1e-5 and tiny.optim.critic_lr == 5e-4 and a.critic == "separate"


def test_leafe_on_a_pretrained_model_reads_pass_at_128():
    assert load_config("leafe", env="sokoban", model="smollm2").eval.samples == 128
    assert load_config("leafe", env="alfworld", model="smollm2").eval.samples == 128
    assert load_config("leafe", env="sokoban").eval.samples == 8  # the CPU demo


def test_spear_has_the_papers_buffers_and_the_tiny_model_small_ones():
    for recipe in ("spear", "spear_dr_bot", "spear_gigpo"):
        assert load_config(recipe, env="sokoban").extra["buffer_size"] == 16
        assert "buffer_size" not in load_config(recipe, env="sokoban", model="smollm2").extra  # Params: 2048


def test_crps_yaml_says_where_each_controller_value_comes_from():
    lines = {ln.split(":")[0].strip(): ln for ln in (ROOT / "recipes/crps.yaml").read_text().splitlines()
             if ln.startswith("  ") and not ln.strip().startswith("#")}
    text = (ROOT / "recipes/crps.yaml").read_text()
    for key in ("ema", "band", "delta", "p_replay"):
        assert "paper:" in lines[key], key
    for key in ("alpha_max", "beta_min", "capacity", "mastery_acc"):
        assert "not in the paper" in (lines[key] + text.split(f"  {key}:")[0].splitlines()[-1]), key
