"""A user's own recipe, estimator, loss, filter and env, from the user's own package (written to a tmp folder
on PYTHONPATH): named by import path in a YAML or on the command line, or registered by name in a module
that ``--import`` / ``$AGENTRL_PLUGINS`` brings in; no edit of agentrl."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from agentrl.config import ConfigError

ENVS = '''
from agentrl.envs import PromptSpec, TextEnv, register
from agentrl.envs.base import IndexedTasks

DIGITS = list("123456789")


class GuessEnv(TextEnv):
    name, default_max_steps = "guess", 3
    splits = IndexedTasks({"train": 100, "valid": 10, "test": 10})

    def tasks(self, split):
        return self.splits.tasks(split)

    def prompt_spec(self):
        return PromptSpec(system="You play a guessing game.", instruction="Find the digit from 1 to 9.")

    def _reset(self, task, seed):
        self.target = str(1 + int(task.task_id.split("/")[1]) % 9)
        return "Guess a digit.", {"admissible_actions": DIGITS}

    def _step(self, action):
        won = action == self.target
        return ("Right!" if won else "Wrong."), float(won), won, {"won": won, "admissible_actions": DIGITS}

    def expert_action(self):
        return self.target


register("guess", "myplug.envs:GuessEnv", "a digit-guessing game")
'''

RECIPES = '''
import torch

from agentrl.algos.advantages import Advantages, per_episode
from agentrl.recipe import GroupRecipe

SEEN = []


class ShortGRPO(GroupRecipe):
    base = "grpo"

    def turn_rewards(self, ep):
        return [r - 0.01 for r in super().turn_rewards(ep)]

    def after_update(self, trainer, stats):
        stats["short_grpo_updates"] = 1.0


def centered(x):
    SEEN.append(len(x.rewards))
    return per_episode(x.rewards - x.rewards.mean(), x)


def keep_all(episodes, ctx):
    return episodes, 0


def pg(logp, old_logp, adv, mask, cfg):
    return -(adv * logp * mask).sum() / mask.sum().clamp(min=1), {}
'''


@pytest.fixture
def user_pkg(tmp_path, monkeypatch):
    pkg = tmp_path / "src" / "myplug"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "envs.py").write_text(textwrap.dedent(ENVS))
    (pkg / "algo.py").write_text(textwrap.dedent(RECIPES))
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "src"), os.environ.get("PYTHONPATH", "")]))
    yield tmp_path
    for name in [m for m in sys.modules if m == "myplug" or m.startswith("myplug.")]:
        del sys.modules[name]


def test_a_recipe_class_by_import_path_takes_its_base_settings(user_pkg):
    from agentrl.config_loader import load_config
    from agentrl.recipe import RECIPES

    cfg = load_config("myplug.algo:ShortGRPO", env="sokoban")
    grpo = load_config("grpo", env="sokoban")
    assert cfg.method == "myplug.algo:ShortGRPO" and cfg.recipe == "shortgrpo"
    assert cfg.algo == grpo.algo and cfg.rollout == grpo.rollout  # base = "grpo": GRPO's settings
    recipe = RECIPES.get(cfg.method)(cfg)
    assert type(recipe).__name__ == "ShortGRPO" and recipe.cfg is cfg


def test_a_yaml_names_its_class_and_its_estimator_loss_and_filter_by_import_path(user_pkg):
    from agentrl.config_loader import load_config
    from agentrl.recipe import RECIPES
    from agentrl.types import Episode, Turn

    y = user_pkg / "mine.yaml"
    y.write_text("base: grpo\nrecipe: myplug.algo:ShortGRPO\nalgo:\n  estimator: myplug.algo:centered\n"
                 "  loss: myplug.algo:pg\n  filters: [myplug.algo:keep_all]\n")
    cfg = load_config(str(y), env="sokoban")
    assert (cfg.recipe, cfg.method, cfg.algo.estimator) == ("mine", "myplug.algo:ShortGRPO", "myplug.algo:centered")
    recipe = RECIPES.get(cfg.method)(cfg)
    turn = Turn([1, 2], [3, 4], [-1.0, -1.0], "<answer>Up</answer>", ["Up"], True, "o", 0.0, True)
    eps = [Episode("sokoban", "t", 0, group_id="g", turns=[turn], won=w) for w in (True, False)]
    samples, stats = recipe.make_batch(None, eps)
    import myplug.algo

    assert myplug.algo.SEEN == [2] and stats["filtered_myplug.algo:keep_all"] == 0
    assert [s.advantages[s.loss_mask.index(1)] for s in samples] == pytest.approx([0.5, -0.5])


@pytest.mark.parametrize("key,value,says", [
    ("algo.estimator", "myplug.algo:nothing", "module 'myplug.algo' has no 'nothing'"),
    ("algo.loss", "nopkg.mod:pg", "cannot import 'nopkg.mod'"),
    ("algo.estimator", "grpoo", "allowed: "),
])
def test_a_bad_import_path_fails_in_one_line_naming_the_key(user_pkg, key, value, says):
    from agentrl.config_loader import load_config

    with pytest.raises(ConfigError, match=rf"bad value for '{key}': .*{says}") as e:
        load_config("grpo", env="sokoban", overrides=[f"{key}={value}"])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="bad value for 'recipe': .*cannot import 'nopkg'"):
        load_config("nopkg:Recipe", env="sokoban")


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_an_env_registered_in_the_users_module_is_known_by_name_with_import_or_plugins(user_pkg):
    r = _cli("envs", "check", "guess", "--tasks", "3", "--replay-tasks", "2")
    assert r.returncode == 2 and "unknown env 'guess'" in r.stderr and "--import" in r.stderr
    r = _cli("envs", "check", "guess", "--tasks", "3", "--replay-tasks", "2", "--import", "myplug.envs")
    assert r.returncode == 0 and "guess: expert success 3/3" in r.stdout, r.stderr[-2000:]
    r = _cli("envs", "list", "--json", "--only", "guess", env={"AGENTRL_PLUGINS": "myplug.envs"})
    assert r.returncode == 0 and json.loads(r.stdout)[0]["env"] == "guess", r.stderr[-2000:]
    r = _cli("--import", "myplug.nope", "envs", "list")
    assert r.returncode == 2 and "cannot import 'myplug.nope'" in r.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_a_users_recipe_on_a_users_env_in_worker_processes(user_pkg, tiny_model_dir):
    """One real step of the user's recipe class on the user's registered env, its envs in spawned worker
    processes (they import the plugin from $AGENTRL_PLUGINS, which --import sets)."""
    out = user_pkg / "run"
    r = _cli("train", "myplug.algo:ShortGRPO", "--env", "guess", "--import", "myplug.envs", "--model",
             str(tiny_model_dir), "--out", str(out), "trainer.steps=1", "trainer.tensorboard=false",
             "trainer.progress=false", "trainer.checkpoint_every=100", "rollout.groups=2", "rollout.group_size=2",
             "rollout.pool=process", "eval.tasks=2", "eval.every=0", "sft.enabled=false",
             "algo.estimator=myplug.algo:centered", "algo.filters=[]",
             env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and rows[-1]["short_grpo_updates"] == 1.0  # the user's class ran the step
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert (saved["method"], saved["algo"]["estimator"]) == ("myplug.algo:ShortGRPO", "myplug.algo:centered")


def test_an_installed_packages_entry_point_registers_its_names(user_pkg, monkeypatch):
    """``[project.entry-points."agentrl.plugins"]``: the module is imported before the first lookup."""
    import importlib.metadata

    from agentrl import registry as reg
    from agentrl.envs.registry import ENVS, names

    monkeypatch.setattr(ENVS, "_items", dict(ENVS._items))  # the name goes with the test
    ep = importlib.metadata.EntryPoint("myplug", "myplug.envs", reg.ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [ep] if group == reg.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(reg, "_loaded", set())
    assert "guess" in names()
