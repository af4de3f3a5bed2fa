"""Any Gymnasium env with text observations and text actions as an agentrl env (``env: gymnasium:<id>``
in a recipe, kwargs in ``env_kwargs``).

Tasks are seeds: ``train/00042`` resets the env with seed 42 (valid and test seeds are offset so the
splits never share one). Restore is replay-prefix: a seeded reset plus the recorded actions, each step's
observation checked against the fingerprint recorded when the trajectory was collected, so an env that
is not deterministic under replay is caught (``DivergenceError``), never silently wrong. ``check()`` runs
that replay once up front and says so in one line. The prompt (instruction, answer tag) comes from the
kwargs. GEM, TextArena and reasoning-gym envs come in through the same class (``gem:<id>``,
``textarena:<id>``, ``rg:<dataset>``; the small Gymnasium shims are in ``envs/suites.py``)."""
from __future__ import annotations

import importlib
from typing import Any, Callable

from agentrl.envs.base import SPLITS, EnvError, PromptSpec, Task, TextEnv

SPLIT_OFFSET = {"train": 0, "valid": 1_000_000, "test": 2_000_000}


class GymnasiumTextEnv(TextEnv):
    name = "gymnasium"
    default_max_steps = 50

    def __init__(self, gym_id: str, gym_kwargs: dict[str, Any] | None = None, tasks_per_split: int = 1000,
                 instruction: str = "", system: str = "You are an agent acting in a text environment.",
                 answer_tag: str = "action", max_steps: int | None = None, win_reward: float | None = None,
                 expert: str = "", suite: str = ""):
        """``win_reward``: a final reward at or above it is a win (default: any reward above 0). ``expert``:
        where SFT demonstrations come from: ``""`` none, ``"sample"`` the env's own ``sample_action()``
        (GEM's random actions: the format, no strategy), or ``"module:function"`` called with the env.
        ``suite``: ``gem``, ``textarena`` or ``rg`` to make ``gym_id`` from that suite (``envs/suites.py``)."""
        super().__init__(max_steps=max_steps)
        self.env = _make(suite, gym_id, gym_kwargs or {})
        gym_id = f"{suite}:{gym_id}" if suite else gym_id
        self.gym_id, self.n_tasks, self.win_reward = gym_id, tasks_per_split, win_reward
        self._expert = _expert(gym_id, expert, self.env)
        self.spec_ = PromptSpec(system=system, instruction=instruction or f"Act in the text environment {gym_id}.",
                                answer_tag=answer_tag)

    def tasks(self, split: str) -> list[Task]:
        if split not in SPLITS:
            raise EnvError(f"env '{self.name}': unknown split '{split}'")
        return [Task(f"{split}/{i:05d}", split) for i in range(self.n_tasks)]

    def prompt_spec(self) -> PromptSpec:
        return self.spec_

    def _text(self, obs: Any, where: str) -> str:
        if not isinstance(obs, str):
            raise EnvError(f"gymnasium env '{self.gym_id}': {where} returned a {type(obs).__name__} observation, "
                           "not text; wrap it so observations are strings")
        return obs

    def _reset(self, task: Task, seed: int) -> tuple[str, dict[str, Any]]:
        split, idx = task.task_id.split("/", 1)
        obs, info = self.env.reset(seed=SPLIT_OFFSET[split] + int(idx))
        return self._text(obs, "reset"), dict(info or {})

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        info = dict(info or {})
        if truncated and not terminated:  # the env's own time limit ends the episode too
            terminated = True
            info["env_truncated"] = True
        won = float(reward) > 0 if self.win_reward is None else float(reward) >= self.win_reward
        info.setdefault("won", won and bool(terminated))
        return self._text(obs, "step"), float(reward), bool(terminated), info

    def expert_action(self) -> str | None:
        return self._expert() if self._expert else None

    def check(self, task_id: str = "train/00000", actions: tuple[str, ...] = ("look", "help", "1")) -> None:
        """Play ``actions`` and replay them from a fresh seeded reset: a different observation means the env
        is not deterministic under replay, so replay-prefix restore cannot be trusted (one-line error)."""
        from agentrl.envs.replay import DivergenceError, play, replay

        trace, _, _ = play(self, task_id, 0, lambda k: actions[k] if k < len(actions) else None)
        try:
            replay(self, trace)
        except DivergenceError as e:
            raise EnvError(f"gymnasium env '{self.gym_id}' is not deterministic under replay (seeded reset + the "
                           f"same actions gave another state at step {e.step}): replay-prefix restore cannot "
                           "be used with it") from None

    def close(self) -> None:
        self.env.close()


def _make(suite: str, gym_id: str, kwargs: dict[str, Any]) -> Any:
    """``gym.make(gym_id)``, or an outside suite's env behind its Gymnasium shim; any failure (a missing
    package, an unknown id) is one line naming the env."""
    from agentrl.envs.suites import SUITES, make_suite_env

    name = f"{suite}:{gym_id}" if suite else gym_id
    try:
        if suite:
            if suite not in SUITES:
                raise EnvError(f"env '{name}': unknown suite '{suite}' (known: {', '.join(SUITES)})")
            module, package = SUITES[suite]
            try:
                importlib.import_module(module)
            except ImportError:
                raise EnvError(f"env '{name}' needs the {package} package: pip install -e '.[suites]' "
                               "(make setup installs it)") from None
            return make_suite_env(suite, gym_id, kwargs)
        import gymnasium as gym

        return gym.make(gym_id, **kwargs)
    except EnvError:
        raise
    except Exception as e:
        label = f"env '{name}'" if suite else f"gymnasium env '{name}'"
        why = " ".join(str(e).replace("*", " ").split())[:300]  # one line, however the package words it
        raise EnvError(f"{label} cannot be made: {type(e).__name__}: {why}") from None


def _expert(gym_id: str, expert: str, env: Any) -> Callable[[], str] | None:
    if not expert:
        return None
    if expert == "sample":
        sample = getattr(env, "sample_action", None)
        if sample is None:
            raise EnvError(f"env '{gym_id}': expert 'sample' needs an env with sample_action() (GEM's have it)")
        return sample
    module, _, fn = expert.partition(":")
    try:
        f = getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError, ValueError) as e:
        raise EnvError(f"env '{gym_id}': expert '{expert}' is not an importable module:function ({e})") from None
    return lambda: f(env)
