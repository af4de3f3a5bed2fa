"""Env registry: a name maps to a class path plus default options.

Entries are strings (``"agentrl.envs.sokoban:SokobanEnv"``) so listing envs never imports heavy engines
(Java for ScienceWorld, Inform7 for TextWorld) and env worker processes can build envs by name. The names
live in a ``Registry`` like the recipes' and estimators': a user's module that calls ``register`` is
imported before the first lookup when listed in ``$AGENTRL_PLUGINS`` or as an ``agentrl.plugins`` entry
point (``agentrl.registry``); env worker processes inherit the variable, so they find the name too.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentrl.envs.base import EnvError, TextEnv
from agentrl.registry import Registry, load_object

if TYPE_CHECKING:
    from agentrl.envs.slots import EnvSlots


@dataclass(frozen=True)
class EnvSpec:
    name: str
    entry: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    fast: bool = False  # pure Python, no engine or generation to start: checked by `make envs` and the tests

    def load_class(self) -> type[TextEnv]:
        return load_object(self.entry, f"env '{self.name}'")


ENVS = Registry("env")  # name -> EnvSpec
# outside suites (``envs/suites.py``): GEM, TextArena and reasoning-gym score a solved task 1.0
SUITE_DEFAULTS: dict[str, dict[str, Any]] = {
    "gem": {"win_reward": 1.0, "expert": "sample"},
    "textarena": {"win_reward": 1.0},
    "rg": {"win_reward": 1.0, "max_steps": 1},
}


def register(name: str, entry: str, description: str = "", *, fast: bool = False, **kwargs: Any) -> None:
    """``kwargs`` are the env's default options; ``fast`` marks an env cheap enough for every quick check."""
    if ":" not in entry:
        raise EnvError(f"register('{name}', {entry!r}): the entry must look like package.module:EnvClass")
    old = ENVS.registered(name)
    if old is not None and old.entry != entry:
        raise EnvError(f"env '{name}' is already registered to {old.entry}")
    ENVS.register(name, replace=True)(EnvSpec(name, entry, dict(kwargs), description, fast))


def spec(name: str) -> EnvSpec:
    """A registered name, ``"gymnasium:<id>"`` (any Gymnasium text env, ``envs/from_gymnasium.py``),
    ``"latency:<name>"`` (that env with a random per-step delay, ``envs/latency.py``),
    ``"agent:<package.module:function>"`` (an agent program, ``envs/agent_program.py``),
    ``"gem:<id>"``/``"textarena:<id>"``/``"rg:<dataset>"`` (outside suites, ``envs/suites.py``), or a
    ``"package.module:EnvClass"`` path for an env that is not registered."""
    if name.startswith("gymnasium:"):
        return EnvSpec(name, "agentrl.envs.from_gymnasium:GymnasiumTextEnv", {"gym_id": name.split(":", 1)[1]})
    if name.startswith("agent:"):  # any agent program, driven through the capture endpoint (envs/agent_program.py)
        return EnvSpec(name, "agentrl.envs.agent_program:AgentProgramEnv", {"program": name.split(":", 1)[1]})
    if name.startswith("latency:"):  # any env with a random per-step delay (envs/latency.py)
        return EnvSpec(name, "agentrl.envs.latency:LatencyEnv", {"inner": name.split(":", 1)[1]})
    suite, _, inner = name.partition(":")
    if suite in SUITE_DEFAULTS and inner:
        return EnvSpec(name, "agentrl.envs.from_gymnasium:GymnasiumTextEnv",
                       {"gym_id": inner, "suite": suite, **SUITE_DEFAULTS[suite]})
    if name not in ENVS and ":" in name:
        return EnvSpec(name, name)
    if name not in ENVS:
        raise EnvError(f"unknown env '{name}'; registered envs: {', '.join(ENVS.names())} (an env registered in "
                       "your own module: agentrl --import mypkg.mod, or $AGENTRL_PLUGINS)")
    return ENVS.get(name)


def make(name: str, **kwargs: Any) -> TextEnv:
    s = spec(name)
    env = s.load_class()(**{**s.kwargs, **kwargs})
    env.name = name  # variants share a class; report the registered name
    return env


# env-slot pools by ``rollout.pool``: each is built as (env name, slots, env kwargs, **its own options)
POOLS: dict[str, str] = {"inprocess": "agentrl.envs.pool:InProcessEnvs", "process": "agentrl.envs.pool:EnvPool",
                         "ray": "agentrl.envs.ray_pool:RayEnvPool"}


def make_pool(kind: str, env_name: str, num_slots: int, env_kwargs: dict[str, Any] | None = None,
              **options: Any) -> "EnvSlots":
    """``num_slots`` envs of ``env_name`` in the pool named ``kind`` (imported only when chosen)."""
    if kind not in POOLS:
        raise EnvError(f"rollout.pool: unknown pool '{kind}'; choose one of {', '.join(POOLS)}")
    module, _, cls = POOLS[kind].partition(":")
    return getattr(importlib.import_module(module), cls)(env_name, num_slots, env_kwargs, **options)


def names() -> list[str]:
    return ENVS.names()


def fast_names() -> list[str]:
    """The envs registered as fast, in registration order (the one list `make envs` and the tests use)."""
    return [n for n, s in ENVS.items().items() if s.fast]


register("sokoban", "agentrl.envs.sokoban:SokobanEnv", "RAGEN Sokoban, 6x6, 1 box", fast=True)
register("sokoban-large", "agentrl.envs.sokoban:SokobanEnv", "RAGEN LargerSokoban, 8x8, 2 boxes", fast=True,
         dim=8, num_boxes=2)
register("sokoban-newvocab", "agentrl.envs.sokoban:SokobanEnv", "RAGEN SokobanDifferentGridVocab", fast=True,
         vocab="new")
register("frozenlake", "agentrl.envs.frozenlake:FrozenLakeEnv", "gymnasium FrozenLake-v1, slippery, random 4x4 maps",
         fast=True)
register("bandit", "agentrl.envs.bandit:BanditEnv", "RAGEN bi-arm bandit (symbolic arm names)", fast=True)
register("bandit-reversed", "agentrl.envs.bandit:BanditEnv", "bi-arm bandit with the name semantics reversed",
         fast=True, reversed=True)
register("calc-tools", "agentrl.envs.calc_tools:CalcToolsEnv",
         "arithmetic with a calculator tool: tool calls, tool messages, a final <answer>", fast=True)
register("shop-tools", "agentrl.envs.shop_tools:ShopToolsEnv",
         "product search with search and view tools over WebShop's catalogue (retrieval), a final <answer>",
         fast=True)
register("textworld", "agentrl.envs.textworld_env:TextWorldEnv", "TextWorld games generated locally (tw-make)")
register("scienceworld", "agentrl.envs.scienceworld_env:ScienceWorldEnv", "ScienceWorld, 30 tasks (Java)")
register("alfworld", "agentrl.envs.alfworld_env:AlfWorldEnv",
         "ALFWorld on alfworld's TextWorld-PDDL engine; generated games, or $ALFWORLD_DATA")
register("webshop", "agentrl.envs.webshop.env:WebShopEnv",
         "WebShop pages, actions and reward; generated catalogue, or $WEBSHOP_DATA")
