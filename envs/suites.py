"""Outside env suites as Gymnasium text envs, so ``from_gymnasium.GymnasiumTextEnv`` runs them unchanged.

* ``gem:<id>``: GEM (``pip install gem-llm``), e.g. ``gem:game:GuessTheNumber-v0-easy``; its API is
  already Gymnasium's, only its terminal marker is dropped.
* ``textarena:<id>``: TextArena single-player games, e.g. ``textarena:GuessTheNumber-v0-raw``; played as
  player 0 of one, the messages since the last turn are the observation, the final reward is
  ``close()``'s.
* ``rg:<dataset>``: a reasoning-gym dataset as a one-turn env: the seed picks the problem, the answer is
  scored by the dataset's own ``score_answer``.

All three seed Python's and NumPy's global generators at reset. Each env here keeps its own copy of those
states and swaps it in around every call, so the suites neither disturb the trainer's randomness nor
each other's (several envs share one process in the in-process pool).
"""
from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator

import gymnasium as gym
import numpy as np
from gymnasium import spaces

SUITES = {"gem": ("gem", "gem-llm"), "textarena": ("textarena", "textarena"), "rg": ("reasoning_gym", "reasoning-gym")}
MAX_TEXT = 1 << 16


class _SuiteEnv(gym.Env):
    """Shared parts: text spaces and a private copy of the global random states."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = spaces.Text(MAX_TEXT, min_length=0)
        self.action_space = spaces.Text(MAX_TEXT, min_length=0)
        self._rng_state: tuple[Any, Any] | None = None

    @contextlib.contextmanager
    def _own_rng(self) -> Iterator[None]:
        outer = random.getstate(), np.random.get_state()
        if self._rng_state is not None:
            random.setstate(self._rng_state[0])
            np.random.set_state(self._rng_state[1])
        try:
            yield
        finally:
            self._rng_state = random.getstate(), np.random.get_state()
            random.setstate(outer[0])
            np.random.set_state(outer[1])


class GemEnv(_SuiteEnv):
    def __init__(self, env_id: str, **kwargs: Any):
        super().__init__()
        import gem
        from gem.utils.constants import TERMINAL_STATE

        self._terminal = TERMINAL_STATE
        with self._own_rng():
            self.env = gem.make(env_id, **kwargs)

    def _text(self, obs: Any) -> Any:
        return "" if obs == self._terminal else obs

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        with self._own_rng():
            obs, info = self.env.reset(seed=seed)
        return self._text(obs), dict(info or {})

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict]:
        with self._own_rng():
            obs, reward, terminated, truncated, info = self.env.step(action)
        return self._text(obs), float(reward), bool(terminated), bool(truncated), dict(info or {})

    def sample_action(self) -> str:
        """GEM's own random action (right format, no strategy): a format-only demonstrator."""
        with self._own_rng():
            return str(self.env.sample_random_action())


class TextArenaEnv(_SuiteEnv):
    def __init__(self, env_id: str, **kwargs: Any):
        super().__init__()
        import textarena as ta

        with self._own_rng():
            self.env = ta.make(env_id, **kwargs)

    def _observe(self) -> str:
        _, obs = self.env.get_observation()
        if isinstance(obs, str):  # a wrapped id (no -raw) renders the whole history itself
            return obs
        # the raw form: (sender, message, type) since the last call; our own actions are not repeated back
        return "\n".join(str(msg) for sender, msg, *_ in obs if sender != 0)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        with self._own_rng():
            self.env.reset(num_players=1, seed=seed)
            return self._observe(), {}

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict]:
        with self._own_rng():
            done, info = self.env.step(action)
            obs = self._observe()
            reward = 0.0
            info = dict(info or {})
            if done:
                rewards, game_info = self.env.close()
                reward = float((rewards or {}).get(0, 0.0))
                mine = (game_info or {}).get(0) or {}
                info.update({k: v for k, v in mine.items() if isinstance(v, (str, int, float))})
        return obs, reward, bool(done), False, info


class ReasoningGymEnv(_SuiteEnv):
    def __init__(self, dataset: str, **config: Any):
        super().__init__()
        import reasoning_gym

        self._create, self.dataset, self.config = reasoning_gym.create_dataset, dataset, config
        self._data: Any = None
        self._entry: dict[str, Any] = {}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        with self._own_rng():
            self._data = self._create(self.dataset, size=1, seed=int(seed or 0), **self.config)
            self._entry = self._data[0]
        return str(self._entry["question"]), {}

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict]:
        with self._own_rng():
            score = float(self._data.score_answer(answer=action, entry=self._entry))
        return "", score, True, False, {"answer": str(self._entry["answer"])}


def make_suite_env(suite: str, env_id: str, kwargs: dict[str, Any]) -> gym.Env:
    cls = {"gem": GemEnv, "textarena": TextArenaEnv, "rg": ReasoningGymEnv}[suite]
    return cls(env_id, **kwargs)


def suite_ids(suite: str) -> list[str]:
    """Every id the installed suite registers (ImportError when it is not installed)."""
    if suite == "gem":
        from gem.envs.registration import ENV_REGISTRY
    elif suite == "textarena":
        from textarena.envs.registration import ENV_REGISTRY
    else:
        from reasoning_gym.factory import DATASETS as ENV_REGISTRY
    return sorted(ENV_REGISTRY)
