"""ScienceWorld through the real ``scienceworld`` package (a Java simulator behind py4j).

Tasks are (task name, variation) pairs in the package's own train/dev/test variation splits; the
category is the task name. The expert is the package's gold action sequence, valid from the start of
an episode while the agent stays on it. There is no native snapshot: restore is replay-prefix.

The prompt describes the action grammar (the simulator's templates, with OBJ an object the observation
names; LEAFE's setup also has the model compose its actions from templates) instead of listing every
valid action: that list (every template filled with every object in view) runs to hundreds of actions
(the first step of a task: 229-417 actions, 3,000-6,700 tokens of the tiny model's tokenizer), more than
a small model's context.
``admissible_actions`` still holds them (constrained decoding, parsing, demonstrations);
``valid_actions=True`` lists them in the prompt too, for a model with the context for it.
"""
from __future__ import annotations

import json
import re
from typing import Any

from agentrl.envs.base import EnvError, PromptSpec, Task, TextEnv
from agentrl.envs.cache import cache_dir
from agentrl.io_atomic import atomic_write_text

# Tasks whose simulation draws unseeded randomness (plant life cycles, pollination, heating timing): two
# runs of the same gold actions diverge (measured: first divergence at step 47 for both mendelian tasks,
# 60 for grow-fruit, 20 for use-thermometer, 44 in one of two runs of measure-melting-point-unknown-
# substance variation 6). Their replays are checked and fail loudly.
NONDETERMINISTIC_TASKS = {"mendelian-genetics-known-plant", "mendelian-genetics-unknown-plant", "grow-fruit",
                          "use-thermometer", "measure-melting-point-unknown-substance"}
# The simulator's action templates (its README's table; ``go to`` as its parser and gold paths write it).
GRAMMAR = ("Actions are plain commands, OBJ an object you can see and LOC a room: look around, look at OBJ, "
           "look in OBJ, read OBJ, go to LOC, open OBJ, close OBJ, pick up OBJ, put down OBJ, move OBJ to OBJ, "
           "pour OBJ in OBJ, dunk OBJ in OBJ, mix OBJ, activate OBJ, deactivate OBJ, connect OBJ to OBJ, "
           "disconnect OBJ, use OBJ on OBJ, eat OBJ, flush OBJ, focus on OBJ (the task's object: focusing on "
           "the wrong one fails the task), inventory, task, wait, wait1.")
PACKAGE_SPLIT = {"train": "get_variations_train", "valid": "get_variations_dev", "test": "get_variations_test"}


def _task_table(sw: Any) -> dict[str, dict[str, list[int]]]:
    """task name -> split -> variation indices; computed once per package version (needs the JVM)."""
    import scienceworld

    path = cache_dir("scienceworld") / f"tasks-{getattr(scienceworld, '__version__', 'x')}.json"
    if path.exists():
        return json.loads(path.read_text())
    table: dict[str, dict[str, list[int]]] = {}
    for name in sw.get_task_names():
        sw.load(name, 0, "")
        table[name] = {s: list(getattr(sw, fn)()) for s, fn in PACKAGE_SPLIT.items()}
    atomic_write_text(path, json.dumps(table))  # pool workers starting at once on a fresh machine all compute it
    return table


class ScienceWorldEnv(TextEnv):
    name = "scienceworld"
    default_max_steps = 100

    def __init__(self, simplifications: str = "", valid_actions: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        from scienceworld import ScienceWorldEnv as _SW

        self.simplifications, self.valid_actions = simplifications, valid_actions
        # The Java side gets a generous limit; the base class enforces ``max_steps``.
        self.sw = _SW("", envStepLimit=10_000)
        self.table = _task_table(self.sw)
        self._tasks = {s: [Task(f"{s}/{name}/{v}", s, name) for name in sorted(self.table) for v in
                           self.table[name][s]] for s in PACKAGE_SPLIT}
        self._loaded: tuple[str, int] | None = None
        self.gold: list[str] = []
        self.on_gold = True
        self.task_desc = ""
        self.sw_score = 0

    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            raise EnvError(f"scienceworld: unknown split '{split}'")
        return self._tasks[split]

    def prompt_spec(self) -> PromptSpec:
        system = "You are an expert agent operating in the ScienceWorld environment."
        return PromptSpec(system=system if self.valid_actions else f"{system} {GRAMMAR}",
                          instruction=self.task_desc or "Complete the science task.", style="react",
                          answer_tag="action", max_actions_per_turn=1, list_actions=self.valid_actions)

    def instruction(self) -> str:
        return self.task_desc

    def _info(self, sw_info: dict[str, Any], valid: bool = True) -> dict[str, Any]:
        self.sw_score = int(sw_info["score"])
        return dict(won=self.sw_score >= 100, score=max(self.sw_score, 0) / 100.0,
                    admissible_actions=list(sw_info["valid"]), action_is_valid=valid)

    def _reset(self, task: Task, seed: int) -> tuple[str, dict[str, Any]]:
        _, name, var = task.task_id.split("/")
        key = (name, int(var))
        if self._loaded != key:
            self.sw.load(name, int(var), self.simplifications, generateGoldPath=True)
            self.gold = list(self.sw.get_gold_action_sequence())
            self._loaded = key
        obs, sw_info = self.sw.reset()
        self.task_desc = self.sw.get_task_description()
        self.on_gold = True
        return obs.strip(), self._info(sw_info)

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.on_gold and (self.steps >= len(self.gold) or self.gold[self.steps] != action):
            self.on_gold = False
        valid_before = set(self.last_info.get("admissible_actions", ()))
        prev = self.sw_score
        obs, _, done, sw_info = self.sw.step(action)
        info = self._info(sw_info, valid=action in valid_before)
        return obs.strip(), (self.sw_score - prev) / 100.0, bool(done), info

    def replay_deterministic(self, task_id: str) -> bool:
        return task_id.split("/")[1] not in NONDETERMINISTIC_TASKS

    def canonical_obs(self, obs: str) -> str:
        # The simulator iterates hash sets: one state, several listing orders (seen on replays of the
        # same variation). Sort the listed items so the fingerprint depends only on what is listed.
        items = re.split(r"\n|, | and |: |\(containing |\(|\)", obs)
        return "\n".join(sorted(i.strip() for i in items if i.strip()))

    def expert_action(self) -> str | None:
        if self.on_gold and self.steps < len(self.gold):
            return self.gold[self.steps]
        return None

    def close(self) -> None:
        if getattr(self, "sw", None) is not None:
            self.sw.close()
            self.sw = None
