"""FrozenLake as in RAGEN: gymnasium's FrozenLake-v1 (slippery) on random maps, text boards.

The dynamics, map generator and RNG are gymnasium's own. The board is rendered in RAGEN's symbols
(drawn from the map, not from gymnasium's ``ansi`` render, whose colour codes would leak into prompts).
The RNG state is part of the fingerprint, so a replay that draws different slips is caught, and it is
included in snapshots.
"""
from __future__ import annotations

import copy
from typing import Any

import numpy as np

from agentrl.envs.base import IndexedTasks, PromptSpec, Task, TextEnv

ACTIONS = ["Left", "Down", "Right", "Up"]  # gymnasium's action order 0..3
SPLIT_SEED = {"train": 0, "valid": 1_000_003, "test": 2_000_029}

def value_iteration(P: dict, n_states: int, gamma: float = 0.99, iters: int = 2000) -> np.ndarray:
    """Optimal action values of the known transition model (the expert's policy)."""
    q = np.zeros((n_states, 4))
    v = np.zeros(n_states)
    for _ in range(iters):
        for s in range(n_states):
            for a in range(4):
                q[s, a] = sum(p * (r + (0.0 if done else gamma * v[s2])) for p, s2, r, done in P[s][a])
        nv = q.max(axis=1)
        if np.abs(nv - v).max() < 1e-10:
            break
        v = nv
    return q


class FrozenLakeEnv(TextEnv):
    name = "frozenlake"
    supports_snapshot = True
    stochastic = True
    default_max_steps = 100  # gymnasium's TimeLimit for 4x4

    def __init__(self, size: int = 4, p_frozen: float = 0.8, slippery: bool = True,
                 num_train: int = 10_000, num_valid: int = 500, num_test: int = 500, **kwargs: Any):
        super().__init__(**kwargs)
        import gymnasium  # noqa: F401  (import here: listing envs must stay cheap)
        self.size, self.p_frozen, self.slippery = size, p_frozen, slippery
        self._tasks = IndexedTasks({"train": num_train, "valid": num_valid, "test": num_test})
        self.gym: Any = None
        self._q: np.ndarray | None = None

    def tasks(self, split: str) -> list[Task]:
        return self._tasks.tasks(split)

    def get_task(self, task_id: str) -> Task:
        split, _ = self._tasks.parse(self.name, task_id)
        return Task(task_id, split, "")

    def prompt_spec(self) -> PromptSpec:
        return PromptSpec(
            system="You're a helpful assistant. You always respond by first wrapping your thoughts in "
                   "<think>...</think>, then giving your answer in <answer>...</answer>. "
                   "Max response length: 200 words (tokens).",
            instruction="You are solving the FrozenLake puzzle. Forbid the hole and go to the target. You may move "
                        "to the unintended direction due to the slippery ice. Example answer format: <think>To "
                        "forbid the hole and go to the target, I should go left then go up.</think><answer>Left || "
                        "Up</answer>",
            style="ragen", answer_tag="answer", max_actions_per_turn=5,
            symbols="The meaning of each symbol in the state is:\nP: player, _: empty, O: hole, G: goal, "
                    "X: player in hole, √: player on goal",
        )

    def _make(self, task: Task) -> None:
        import gymnasium
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        _, i = self._tasks.parse(self.name, task.task_id)
        desc = generate_random_map(size=self.size, p=self.p_frozen, seed=SPLIT_SEED[task.split] + i)
        if self.gym is not None:
            self.gym.close()
        # No TimeLimit wrapper: the base class owns the step limit.
        self.gym = gymnasium.make("FrozenLake-v1", desc=desc, is_slippery=self.slippery,
                                  max_episode_steps=None).unwrapped
        self._q = None

    def render(self) -> str:
        g = self.gym
        desc = [[c.decode() for c in row] for row in g.desc]
        r, c = divmod(int(g.s), g.ncol)
        rows = []
        for i, row in enumerate(desc):
            out = []
            for j, ch in enumerate(row):
                if (i, j) == (r, c):
                    out.append({"H": "X", "G": "√"}.get(ch, "P"))
                else:
                    out.append({"H": "O", "G": "G"}.get(ch, "_"))
            rows.append(" ".join(out))
        return "\n".join(rows)

    def _cell(self) -> str:
        r, c = divmod(int(self.gym.s), self.gym.ncol)
        return self.gym.desc[r][c].decode()

    def _info(self, valid: bool = True) -> dict[str, Any]:
        won = self._cell() == "G"
        return dict(won=won, score=float(won), admissible_actions=list(ACTIONS), action_is_valid=valid)

    def _reset(self, task: Task, seed: int) -> tuple[str, dict[str, Any]]:
        self._make(task)
        self.gym.reset(seed=seed)
        return self.render(), self._info()

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        a = {n.lower(): i for i, n in enumerate(ACTIONS)}.get(action.strip().lower())
        if a is None:
            return self.render(), 0.0, False, self._info(valid=False)
        _, reward, terminated, _, _ = self.gym.step(a)
        return self.render(), float(reward), bool(terminated), self._info()

    def hidden_state(self) -> str:
        if self.gym is None:
            return ""
        st = self.gym.np_random.bit_generator.state["state"]
        return f"{st['state']}:{st.get('inc', '')}"

    def reseed(self, seed: int) -> None:
        self.gym.np_random = np.random.default_rng(seed)

    def expert_action(self) -> str | None:
        if self._q is None:
            self._q = value_iteration(self.gym.P, self.gym.observation_space.n)
        return ACTIONS[int(np.argmax(self._q[int(self.gym.s)]))]

    def snapshot(self) -> Any:
        return dict(base=self._base_state(), gym=copy.deepcopy(self.gym), q=self._q)

    def restore(self, snap: Any) -> None:
        self._restore_base(snap)
        self.gym, self._q = copy.deepcopy(snap["gym"]), snap["q"]
