"""agentrl: multi-turn reinforcement learning for LLM agents.

Training from Python::

    import agentrl

    cfg = agentrl.load_config("grpo", env="sokoban", overrides=["trainer.steps=2"])
    with agentrl.Trainer.from_config(cfg) as trainer:  # closes its env workers and generator at the end
        result = trainer.train()  # the final evaluation's metrics
        print(trainer.evaluate())

``import agentrl`` itself is light: it neither imports torch or the envs nor changes the process
environment; each name below is imported the first time it is used.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> (module, attribute in it)
_EXPORTS: dict[str, tuple[str, str]] = {
    "load_config": ("agentrl.config_loader", "load_config"),
    "RecipeCfg": ("agentrl.config", "RecipeCfg"),
    "ConfigError": ("agentrl.schema", "ConfigError"),
    "Trainer": ("agentrl.trainer", "Trainer"),
    "RunError": ("agentrl.trainer", "RunError"),
    "Run": ("agentrl.run", "Run"),
    "Recipe": ("agentrl.recipe", "Recipe"),
    "GroupRecipe": ("agentrl.recipe", "GroupRecipe"),
    "RECIPES": ("agentrl.recipe", "RECIPES"),
    "ESTIMATORS": ("agentrl.algos.advantages", "ESTIMATORS"),
    "LOSSES": ("agentrl.algos.losses", "LOSSES"),
    "FILTERS": ("agentrl.algos.filters", "FILTERS"),
    "TASK_SAMPLERS": ("agentrl.curriculum.task_sampler", "TASK_SAMPLERS"),
    "Episode": ("agentrl.types", "Episode"),
    "Turn": ("agentrl.types", "Turn"),
    "SamplingParams": ("agentrl.types", "SamplingParams"),
    "TextEnv": ("agentrl.envs.base", "TextEnv"),
    "make_env": ("agentrl.envs.registry", "make"),
    "register_env": ("agentrl.envs.registry", "register"),
    "env_names": ("agentrl.envs.registry", "names"),
}
__all__ = ["ConfigError", "ESTIMATORS", "Episode", "FILTERS", "GroupRecipe", "LOSSES", "RECIPES", "Recipe",
           "RecipeCfg", "Run", "RunError", "SamplingParams", "TASK_SAMPLERS", "TextEnv", "Trainer", "Turn", "env_names",
           "load_config", "make_env", "register_env", "__version__"]

if TYPE_CHECKING:  # what type checkers and editors see; at run time ``__getattr__`` imports on first use
    from agentrl.algos.advantages import ESTIMATORS
    from agentrl.algos.filters import FILTERS
    from agentrl.algos.losses import LOSSES
    from agentrl.config import RecipeCfg
    from agentrl.config_loader import load_config
    from agentrl.curriculum.task_sampler import TASK_SAMPLERS
    from agentrl.envs.base import TextEnv
    from agentrl.envs.registry import make as make_env, names as env_names, register as register_env
    from agentrl.recipe import RECIPES, GroupRecipe, Recipe
    from agentrl.run import Run
    from agentrl.schema import ConfigError
    from agentrl.trainer import RunError, Trainer
    from agentrl.types import Episode, SamplingParams, Turn


def __getattr__(name: str) -> Any:  # PEP 562: ``agentrl.Trainer`` imports the trainer when first asked for
    if name not in _EXPORTS:
        raise AttributeError(f"module 'agentrl' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
