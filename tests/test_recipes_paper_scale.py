"""Paper-scale settings a model folder resolves to (issue 84) and the recipe pages' deviation sections."""
from pathlib import Path

import pytest

from agentrl.config_loader import config_sources, load_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text("{}")  # resolving a config reads no weights
    return str(d)


@pytest.mark.parametrize("recipe", ["spear", "spear_gigpo", "spear_dr_bot"])
def test_spear_updates_in_table_8s_mini_batches_on_a_folder(folder, recipe):
    # ppo_mini_batch_size 64 / 1024 / 256 prompts x 8 samples each, counted in turn samples
    for env, samples in (("sokoban", 512), ("alfworld", 8192), ("webshop", 2048)):
        cfg = load_config(recipe, env=env, model=folder)
        assert cfg.algo.mini_batch_samples == samples, (recipe, env)
        assert cfg.algo.ppo_epochs == 1
        assert config_sources(recipe, env=env, model=folder)["algo.mini_batch_samples"] == "recipe"
    demo = load_config(recipe, env="sokoban", model="tiny")
    assert demo.algo.mini_batch_samples == 0 and demo.algo.mini_batches == 4  # the demo's, unchanged


def test_every_recipe_page_says_what_differs_from_the_paper():
    pages = [p for p in sorted((ROOT / "docs/recipes").glob("*.md")) if p.name != "index.md"]
    missing = [p.name for p in pages if "## What differs from the paper" not in p.read_text()]
    assert not missing, f"recipe pages without a 'What differs from the paper(s), and why' section: {missing}"


def test_leafe_samples_its_counterfactuals_among_the_successful_ones():
    """LEAFE keeps cf_per_task of a task's successful counterfactuals drawn at random (the paper samples 3),
    not the first 3 its exploration found; the draw follows the run's seed."""
    import random

    from agentrl.recipes.leafe import pick_counterfactuals

    cf = {"t0": [(i, i % 4 != 3) for i in range(12)], "t1": [(100, False), (101, True)]}  # 9 wins, then 1
    draws = [pick_counterfactuals(cf, 3, random.Random(seed)) for seed in range(20)]
    for d in draws:
        t0 = [s for s in d if s < 100]
        assert len(t0) == 3 and all(s % 4 != 3 for s in t0) and d.count(101) == 1 and 100 not in d
    assert any(sorted(s for s in d if s < 100) != [0, 1, 2] for d in draws)  # not always the first found
    assert pick_counterfactuals(cf, 3, random.Random(7)) == pick_counterfactuals(cf, 3, random.Random(7))
