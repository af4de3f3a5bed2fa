"""The CPU demos' tuning (demo overlays) reaches the demo models only; a model folder gets each recipe's own
(paper) settings, and ``--print-sources`` says where each value came from (issue 84, item 1)."""
from pathlib import Path

import pytest

from agentrl.cli import main
from agentrl.config import ConfigError
from agentrl.config_loader import RECIPE_DIR, config_sources, load_config

RECIPES = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
ENVS = ["sokoban", "frozenlake", "bandit", "alfworld", "webshop", "gem:game:GuessTheNumber-v0-easy"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text("{}")  # resolving a config reads no weights
    return str(d)


def test_no_recipe_gives_a_model_folder_a_demo_value(folder):
    resolved = 0
    for recipe in RECIPES:
        for env in ENVS:
            try:
                sources = config_sources(recipe, env=env, model=folder)
            except ConfigError:
                continue  # a recipe that refuses an env refuses it for every model
            resolved += 1
            demo = {k for k, v in sources.items() if v == "demo overlay"}
            assert not demo, f"{recipe} --env {env} --model FOLDER takes demo values: {sorted(demo)}"
    assert resolved >= 58


def test_crps_alfworld_on_a_folder_is_the_papers_and_tiny_is_the_demos(folder):
    paper = load_config("crps", env="alfworld", model=folder)
    assert (paper.rollout.prompt, paper.rollout.history_len, paper.rollout.max_new_tokens) == ("paper", 2, 512)
    assert (paper.algo.turn_weight, paper.algo.mini_batches, paper.optim.lr) == ("uniform", 1, 1e-6)
    assert not paper.sft.enabled
    assert (paper.extra["p_replay"], paper.extra["capacity"]) == (0.2, 256)
    demo = load_config("crps", env="alfworld", model="tiny")
    assert (demo.rollout.prompt, demo.sft.lr, demo.optim.lr) == ("compact_tried", 1e-3, 5e-5)
    assert load_config("crps", env="alfworld", model="tiny:hidden_size=128").sft.lr == 1e-3  # a sized tiny


def test_print_config_sources_names_each_values_origin(folder, capsys):
    assert main(["train", "crps", "--env", "alfworld", "--model", "tiny", "--print-sources",
                 "rollout.groups=4"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert lines["rollout.groups"].endswith("# user") and lines["optim.lr"].endswith("# demo overlay")
    assert lines["extra.ema"].endswith("# recipe") and lines["extra.capacity"] == "16  # demo overlay"
    assert main(["train", "crps", "--env", "alfworld", "--model", folder, "--print-sources"]) == 0
    assert "demo overlay" not in capsys.readouterr().out
    assert Path(folder).is_dir()


def test_spear_on_a_folder_gets_table_8_and_on_tiny_the_demo(folder):
    paper = load_config("spear", env="alfworld", model=folder)
    r = paper.rollout
    assert (r.groups, r.group_size, r.temperature, r.max_turns, r.max_new_tokens) == (32, 8, 0.4, 50, 512)
    assert paper.optim.lr == 1e-6 and load_config("spear", env="webshop", model=folder).extra["warmup_steps"] == 200
    demo = load_config("spear", env="sokoban", model="tiny")
    assert (demo.rollout.groups, demo.rollout.temperature, demo.optim.lr) == (16, 1.0, 5e-5)
