"""``calc-tools``: arithmetic word problems solved with a calculator tool, the example tool env.

Each task is an expression over 2 to 4 integers (``easy``/``medium``/``hard`` by the number of operands)
with an integer value. The policy may call ``calculator(expression)`` (``envs/calculator.py``: parsed
with ``ast``, bounded in size and time, never ``eval``) as often as it likes within the step limit, then
answers ``<answer>NUMBER</answer>``; a right answer wins 1.0 and ends the episode, as does a wrong one
(with 0). The expert calls the calculator on the task's expression and answers its result: two steps.
"""
from __future__ import annotations

import math
import random
import re
from typing import Any

from agentrl.envs.base import IndexedTasks, Task
from agentrl.envs.calculator import CalcError, evaluate, format_number
from agentrl.envs.tools import Tool, ToolEnv, answer_action, call_action, decode_action

LEVELS = ("easy", "medium", "hard")
CALCULATOR = {"type": "object",
              "properties": {"expression": {"type": "string",
                                            "description": "numbers with + - * / ** // % and parentheses"}},
              "required": ["expression"]}
_NUMBER = re.compile(r"^[-+]?\d[\d,]*(\.\d+)?$")


def problem(split: str, index: int) -> tuple[str, int, str]:
    """(expression, value, level) of a task, from its split and index alone."""
    rng = random.Random(f"calc-tools/{split}/{index}")
    level = LEVELS[index % 3]
    while True:
        n = 2 + LEVELS.index(level)
        nums = [rng.randint(2, 99 if level != "easy" else 999) for _ in range(n)]
        ops = [rng.choice("+-*") for _ in range(n - 1)]
        expr = str(nums[0])
        for op, x in zip(ops, nums[1:]):
            expr = f"({expr}) {op} {x}" if op == "*" and rng.random() < 0.5 and " " in expr else f"{expr} {op} {x}"
        # no deadline: the expression is ours and small; the tool's 50 ms one, on a loaded machine, made a task
        # raise CalcError('took too long') when the process was descheduled mid-evaluation
        value = evaluate(expr, time_limit_s=math.inf)
        if isinstance(value, int) and abs(value) < 10**7:
            return expr, value, level


def read_number(text: str) -> float | None:
    """The number an answer states (``1,234``, ``-5``, ``3.0``), or None."""
    t = text.strip().rstrip(".")
    if not _NUMBER.match(t):
        return None
    return float(t.replace(",", ""))


class CalcToolsEnv(ToolEnv):
    name = "calc-tools"
    default_max_steps = 6
    system = "You are a careful assistant. You solve arithmetic problems with a calculator tool."
    instruction_text = ("Compute the value of the expression. Call the calculator tool to do the arithmetic, then "
                        "give the final answer as <answer>NUMBER</answer>.")

    def __init__(self, train_tasks: int = 10000, eval_tasks: int = 200, **kwargs: Any):
        super().__init__(**kwargs)
        self.splits = IndexedTasks({"train": train_tasks, "valid": eval_tasks, "test": eval_tasks},
                                   category_of=lambda s, i: LEVELS[i % 3])
        self.expression, self.value = "", 0
        self._tools = [Tool("calculator", "Evaluate an arithmetic expression and return its value.", CALCULATOR,
                            self.calculator)]

    def tasks(self, split: str) -> list[Task]:
        return self.splits.tasks(split)

    def tools(self) -> list[Tool]:
        return self._tools

    @staticmethod
    def calculator(expression: str) -> str:
        try:
            return format_number(evaluate(expression))
        except CalcError as e:
            raise ValueError(str(e)) from None  # the env shows it as the call's error observation

    def question(self, task: Task, seed: int) -> str:
        split, index = self.splits.parse(self.name, task.task_id)
        self.expression, self.value, _ = problem(split, index)
        return f"Expression: {self.expression}"

    def score_answer(self, answer: str) -> tuple[float, bool, dict[str, Any]]:
        got = read_number(answer)
        won = got is not None and got == self.value
        return float(won), won, {"expected": self.value}

    def _snapshot_extra(self) -> Any:
        return (self.expression, self.value)

    def _restore_extra(self, extra: Any) -> None:
        self.expression, self.value = extra

    def expert_action(self) -> str | None:
        if self.done:
            return None
        for action, obs in reversed(self.log):  # the calculator's last good result is the answer
            a = decode_action(action)
            if a.kind == "call" and a.name == "calculator" and a.arguments.get("expression") == self.expression \
                    and not obs.startswith("Error"):
                return answer_action(obs)
        return call_action("calculator", {"expression": self.expression})
