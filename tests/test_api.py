"""The Python API: a run driven from code, and an ``import agentrl`` that costs nothing and changes nothing."""
import json
import subprocess
import sys

import pytest

import agentrl


def test_python_api_trains_a_bandit_run_and_evaluates(tiny_model_dir, tmp_path):
    cfg = agentrl.load_config("grpo", env="bandit", overrides=[
        f"model.name={tiny_model_dir}", f"trainer.out_dir={tmp_path}", "trainer.steps=2", "trainer.progress=false",
        "trainer.tensorboard=false", "rollout.groups=2", "rollout.group_size=2", "rollout.slots=4",
        "rollout.max_new_tokens=8", "rollout.fill_groups=0", "eval.tasks=2", "eval.samples=1", "sft.enabled=false"])
    with agentrl.Trainer.from_config(cfg) as trainer:
        assert isinstance(trainer.recipe, agentrl.RECIPES.get(cfg.method))
        _implements_run(trainer)
        result = trainer.train()
        assert trainer.step == 2
        assert 0.0 <= result["eval/success"] <= 1.0  # the final evaluation's metrics
        assert result == json.loads((tmp_path / "final.json").read_text())
        again = trainer.evaluate(n_tasks=2)
        assert {"eval/success", "eval/pass@1"} <= set(again) and len(trainer.eval_episodes) == 2
        assert {e.task_id for e in trainer.eval_episodes} <= set(trainer.task_ids(cfg.eval.split))
        assert all(isinstance(e, agentrl.Episode) and all(isinstance(t, agentrl.Turn) for t in e.turns)
                   for e in trainer.eval_episodes)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]


def _implements_run(trainer):
    """The trainer offers everything the ``Run`` protocol promises the recipes, with compatible signatures."""
    import inspect

    from agentrl.run import RolloutSide

    sides = (agentrl.Run, RolloutSide)  # Run extends the rollout side a recipe's collect sees
    for name in {k for side in sides for k in side.__annotations__}:
        assert hasattr(trainer, name), name
    methods = sorted({n for side in sides for n, v in vars(side).items()
                      if inspect.isfunction(v) and not n.startswith("_")})
    assert {"rollout", "update", "evaluate", "echo", "sync_weights"} <= set(methods)
    for name in methods:
        promised = inspect.signature(getattr(agentrl.Run, name)).parameters
        offered = inspect.signature(getattr(type(trainer), name)).parameters
        assert list(promised) == list(offered)[:len(promised)], name
        assert all(offered[p].default == promised[p].default for p in promised), name


def test_registries_are_filled_without_importing_the_recipes():
    code = ("import agentrl; print(' '.join(agentrl.RECIPES.names())); "
            "print(len(agentrl.ESTIMATORS.names()), len(agentrl.LOSSES.names()), len(agentrl.FILTERS.names()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert {"grpo", "crps", "spear", "leafe", "sft", "eval"} <= set(out[0].split())
    assert all(int(n) > 0 for n in out[1].split())


def test_unknown_recipe_names_the_allowed_ones():
    with pytest.raises(agentrl.ConfigError, match="unknown recipe 'nope'.*grpo"):
        agentrl.load_config("nope")


PROBE = r"""
import os, sys, json
before = dict(os.environ)
import agentrl
print(json.dumps({"heavy": sorted(m for m in ("torch", "transformers", "numpy", "agentrl.envs", "agentrl.trainer")
                                  if m in sys.modules),
                  "changed": sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))}))
"""


def test_import_agentrl_is_light_and_leaves_the_environment_alone():
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY",
                                                                          "LRU_CACHE_CAPACITY")}
    out = json.loads(subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                                    check=True).stdout)
    assert out == {"heavy": [], "changed": []}
