"""RAGEN's bi-arm bandit: two symbolically named arms, one pull per episode.

The low-risk arm always pays 0.15; the high-risk arm pays Bernoulli(0.25), better in expectation.
By default the risky-sounding name is the high-risk arm; ``reversed=True`` swaps the semantics, to probe
whether a policy reasons from rewards or from name priors. Train tasks use one set of names, valid/test
use held-out names. ``won`` means the arm with the higher expected reward was chosen.
"""
from __future__ import annotations

import hashlib
import random
from typing import Any

from agentrl.envs.base import EnvError, PromptSpec, Task, TextEnv

LOW_REWARD, HIGH_P = 0.15, 0.25
NAMES = {
    "train": (["Dragon", "Tiger", "Volcano", "Gambler", "Storm", "Lightning", "Wolf", "Shark", "Hurricane",
               "Daredevil"],
              ["Turtle", "Teacher", "Librarian", "Oak", "Anchor", "Shelter", "Bank", "Lighthouse", "Monk",
               "Blanket"]),
    "heldout": (["Cobra", "Meteor", "Pirate", "Tornado", "Gladiator", "Wildfire"],
                ["Shepherd", "Mountain", "Vault", "Nurse", "Harbor", "Cottage"]),
}


def _pairs(split: str) -> list[tuple[str, str, int]]:
    """(risky name, safe name, order) triples; order 0 lists the risky name first."""
    risky, safe = NAMES["train" if split == "train" else "heldout"]
    orders = (0, 1) if split == "train" else ((0,) if split == "valid" else (1,))
    return [(r, s, o) for r in risky for s in safe for o in orders]


class BanditEnv(TextEnv):
    name = "bandit"
    stochastic = True
    supports_snapshot = True
    default_max_steps = 1

    def __init__(self, reversed: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.reversed = reversed
        self._tasks = {s: [Task(f"{s}/{r}-{f}-{o}", s, "") for r, f, o in _pairs(s)]
                       for s in ("train", "valid", "test")}
        self.arms: tuple[str, str] = ("", "")
        self.high_arm = ""
        self.rng = random.Random(0)

    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            raise EnvError(f"bandit: unknown split '{split}'")
        return self._tasks[split]

    def prompt_spec(self) -> PromptSpec:
        return PromptSpec(
            system="You're a helpful assistant. You always respond by giving your answer in <answer>...</answer>. "
                   "Max response length: 200 words (tokens).",
            instruction="You are playing a bandit game. Goal: Maximize your total reward by choosing which arm "
                        "to pull.",
            style="ragen", answer_tag="answer", max_actions_per_turn=1,
        )

    def _reset(self, task: Task, seed: int) -> tuple[str, dict[str, Any]]:
        risky, safe, order = task.task_id.split("/", 1)[1].split("-")
        self.arms = (risky, safe) if order == "0" else (safe, risky)
        self.high_arm = safe if self.reversed else risky
        self.rng = random.Random(seed)
        a, b = self.arms
        obs = (f"Game Rules:\n1. There are 2 arms, named {a} and {b}\n"
               "2. Each arm has its own reward distribution, related to their names.\n"
               "3. Analyze the symbolic meaning of each arm's name to guess how their reward distribution "
               "might behave.\n"
               "4. Based on the symbolic meaning of their names, which arm do you think is more likely to give "
               f"higher rewards on average? Choose between {a} and {b}, and output like <answer> {a} </answer> "
               f"or <answer> {b} </answer>.")
        return obs, dict(admissible_actions=list(self.arms))

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        choice = {n.lower(): n for n in self.arms}.get(action.strip().lower())
        info: dict[str, Any] = dict(admissible_actions=list(self.arms))
        if choice is None:  # the one pull is spent: the episode ends (not a time limit: terminated)
            info["action_is_valid"] = False
            return f"Invalid arm '{action}'. Choose {self.arms[0]} or {self.arms[1]}.", 0.0, True, info
        if choice == self.high_arm:
            reward = float(self.rng.random() < HIGH_P)
        else:
            reward = LOW_REWARD
        info.update(won=choice == self.high_arm, score=float(choice == self.high_arm))
        return f"You pulled {choice} and received reward {reward:g}.", reward, True, info

    def hidden_state(self) -> str:
        return hashlib.sha1(repr(self.rng.getstate()).encode()).hexdigest()[:12]

    def reseed(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def expert_action(self) -> str | None:
        return self.high_arm

    def snapshot(self) -> Any:
        return dict(base=self._base_state(), arms=self.arms, high=self.high_arm, rng=self.rng.getstate())

    def restore(self, snap: Any) -> None:
        self._restore_base(snap)
        self.arms, self.high_arm = snap["arms"], snap["high"]
        self.rng = random.Random()
        self.rng.setstate(snap["rng"])
