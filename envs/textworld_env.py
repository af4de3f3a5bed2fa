"""TextWorld games generated locally with the textworld package's own generator (what `tw-make` runs).

Each task id maps to generator options and a seed, so a game is the same on every machine; compiled
games are cached under ``$AGENTRL_CACHE/textworld`` (compiling costs seconds, a reset milliseconds).
Admissible commands and the expert (TextWorld's own remaining-walkthrough, ``policy_commands``) come
from the engine; snapshots use the engine's native ``copy()``.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

from agentrl.envs.base import IndexedTasks, PromptSpec, Task, TextEnv
from agentrl.envs.cache import cache_dir

# category -> (rooms, objects, quest length)
LEVELS = {"easy": (2, 3, 2), "medium": (4, 6, 4), "hard": (6, 10, 6)}
SPLIT_SEED = {"train": 0, "valid": 1_000_003, "test": 2_000_029}
HAS_WORD = re.compile(r"[A-Za-z0-9]")
STATUS_TAIL = re.compile(r"\n>\s*(-=.*)?$", re.S)


def clean_feedback(text: str) -> str:
    """Drop TextWorld's ASCII-art banner and the trailing '> ... -= Room =-0/1' status line."""
    text = STATUS_TAIL.sub("", text)
    # Banner art and spacer lines carry no letters or digits; every line of game text does.
    return "\n".join(ln.strip() for ln in text.split("\n") if HAS_WORD.search(ln))


class TextWorldEnv(TextEnv):
    name = "textworld"
    supports_snapshot = True
    default_max_steps = 50

    def __init__(self, num_train: int = 1000, num_valid: int = 100, num_test: int = 100, **kwargs: Any):
        super().__init__(**kwargs)
        cats = list(LEVELS)
        self._tasks = IndexedTasks({"train": num_train, "valid": num_valid, "test": num_test},
                                   category_of=lambda s, i: cats[i % len(cats)])
        self.tw: Any = None
        self.gs: Any = None
        self.objective = ""

    def tasks(self, split: str) -> list[Task]:
        return self._tasks.tasks(split)

    def get_task(self, task_id: str) -> Task:
        split, i = self._tasks.parse(self.name, task_id)
        return self._tasks.tasks(split)[i]

    def prompt_spec(self) -> PromptSpec:
        return PromptSpec(
            system="You are an expert agent playing a text adventure game.",
            instruction=self.objective or "Complete the objective of the text game.",
            style="react", answer_tag="action", max_actions_per_turn=1)

    def instruction(self) -> str:
        return self.objective

    def game_file(self, task: Task) -> Path:
        """Generate and compile the task's game once; later calls (any process) reuse the cache."""
        from textworld import GameOptions
        from textworld.generator import compile_game, make_game

        _, i = self._tasks.parse(self.name, task.task_id)
        rooms, objects, quest = LEVELS[task.category]
        seed = SPLIT_SEED[task.split] + i
        folder = cache_dir("textworld")
        final = folder / f"{task.category}-r{rooms}o{objects}q{quest}-s{seed}.z8"
        if final.exists():
            return final
        tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".gen-"))
        try:
            opts = GameOptions()
            opts.seeds = seed
            opts.nb_rooms, opts.nb_objects, opts.quest_length = rooms, objects, quest
            opts.path = str(tmp / final.name)
            opts.force_recompile = True
            compile_game(make_game(opts), opts)
            # Atomic publish: several env workers may race to build the same game.
            for f in tmp.iterdir():
                os.replace(f, folder / f.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def prepare(self, task_id: str) -> None:
        self.game_file(self.get_task(task_id))

    def _start(self, task: Task) -> None:
        import textworld

        infos = textworld.EnvInfos(admissible_commands=True, policy_commands=True, won=True, lost=True,
                                   score=True, max_score=True, objective=True)
        if self.tw is not None:
            self.tw.close()
        with warnings.catch_warnings():
            # jericho warns that generated games are not in its list of known commercial games: expected.
            warnings.simplefilter("ignore")
            self.tw = textworld.start(str(self.game_file(task)), request_infos=infos)

    def _info(self, valid: bool = True) -> dict[str, Any]:
        gs = self.gs
        max_score = gs["max_score"] or 1
        return dict(won=bool(gs["won"]), lost=bool(gs["lost"]), score=gs["score"] / max_score,
                    admissible_actions=sorted(gs["admissible_commands"] or []), action_is_valid=valid)

    def _reset(self, task: Task, seed: int) -> tuple[str, dict[str, Any]]:
        self._start(task)
        self.gs = self.tw.reset()
        self.objective = self.gs["objective"] or ""
        obs = clean_feedback(self.gs.feedback)
        # The opening feedback repeats the objective; it lives in the instruction instead.
        obs = obs.replace(self.objective, "").strip()
        return obs, self._info()

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        valid = action.lower() in {c.lower() for c in self.gs["admissible_commands"] or []}
        prev = self.gs["score"]
        # the Z-machine reads ASCII: other characters cut its output mid-character (a UnicodeDecodeError);
        # its interpreter takes a line starting with a backslash as its own command and then hangs
        command = action.encode("ascii", "ignore").decode().replace("\\", " ").strip()
        self.gs, _, done = self.tw.step(command)
        reward = float(self.gs["score"] - prev)
        return clean_feedback(self.gs.feedback), reward, bool(done), self._info(valid)

    def expert_action(self) -> str | None:
        cmds = self.gs["policy_commands"] if self.gs is not None else None
        return cmds[0] if cmds else None

    def snapshot(self) -> Any:
        return dict(base=self._base_state(), tw=self.tw.copy(), gs=self.gs, objective=self.objective)

    def restore(self, snap: Any) -> None:
        self._restore_base(snap)
        # Copy again so the snapshot stays reusable after the restored env moves on.
        self.tw, self.gs, self.objective = snap["tw"].copy(), snap["gs"], snap["objective"]

    def close(self) -> None:
        if self.tw is not None:
            self.tw.close()
            self.tw = None
