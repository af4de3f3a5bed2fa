"""Every agentrl env as a ``gymnasium.Env``: ``gymnasium.make("agentrl/Sokoban-v0")`` (after
``import agentrl.envs``), text observation and action spaces, ``reset(seed=, options={"task_id": ...,
"split": ...})``, ``terminated`` and ``truncated`` apart, and the env's ``info`` keys (admissible
actions, won, score, fingerprint, ...) plus the task id and the instruction."""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import gymnasium as gym
from gymnasium import spaces

from agentrl.envs.base import EnvError, TextEnv

MAX_OBS_CHARS = 1 << 16
MAX_ACTION_CHARS = 1 << 12
# gymnasium ids: "agentrl/<Name>-v0"
GYM_NAMES = {"sokoban": "Sokoban", "sokoban-large": "SokobanLarge", "sokoban-newvocab": "SokobanNewVocab",
             "frozenlake": "FrozenLake", "bandit": "Bandit", "bandit-reversed": "BanditReversed",
             "textworld": "TextWorld", "scienceworld": "ScienceWorld", "alfworld": "ALFWorld", "webshop": "WebShop"}


@lru_cache(maxsize=1)
def charset() -> frozenset[str]:
    """Printable characters of the basic multilingual plane, newline and tab: what env text is made of."""
    return frozenset(c for c in map(chr, range(0x20, 0x10000)) if c.isprintable()) | {"\n", "\t"}


def gym_id(name: str) -> str:
    return f"agentrl/{GYM_NAMES.get(name, name.title().replace('-', ''))}-v0"


class AgentrlGymEnv(gym.Env):
    metadata = {"render_modes": ["ansi"]}

    def __init__(self, env: str | TextEnv, split: str = "train", render_mode: str | None = None, **env_kwargs: Any):
        from agentrl.envs.registry import make

        self.env = make(env, **env_kwargs) if isinstance(env, str) else env
        self.split, self.render_mode = split, render_mode
        self.observation_space = spaces.Text(MAX_OBS_CHARS, min_length=0, charset=charset())
        self.action_space = spaces.Text(MAX_ACTION_CHARS, min_length=0, charset=charset())
        self._obs = ""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        options = dict(options or {})
        task_id = options.pop("task_id", None)
        split = options.pop("split", self.split)
        if options:
            raise EnvError(f"{gym_id(self.env.name)}: unknown reset options {sorted(options)}; allowed: task_id, split")
        if task_id is None:  # a task drawn from the split with the env's generator (seeded by ``seed``)
            tasks = self.env.tasks(split)
            task_id = tasks[int(self.np_random.integers(len(tasks)))].task_id
        env_seed = int(self.np_random.integers(2**31))
        obs, info = self.env.reset(task_id, env_seed)
        self._obs = obs
        return obs, dict(info, task_id=task_id, instruction=self.env.instruction())

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(str(action))
        self._obs = obs
        return obs, reward, terminated, truncated, info

    def render(self) -> str | None:
        return self._obs if self.render_mode == "ansi" else None

    def close(self) -> None:
        self.env.close()


def register_all() -> list[str]:
    """A gymnasium id for every registered agentrl env; returns the ids."""
    from agentrl.envs.registry import names

    ids = []
    for name in names():
        gid = gym_id(name)
        if gid not in gym.registry:
            gym.register(id=gid, entry_point="agentrl.envs.gymnasium_api:AgentrlGymEnv", kwargs={"env": name},
                         disable_env_checker=False)
        ids.append(gid)
    return ids
