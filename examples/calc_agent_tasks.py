"""The calc-tools env's problems as tasks for ``examples/calc_agent.py``, so the agent program trains and is
evaluated on the same problems as the built-in env (docs/guides/tools.md, "The calculator agent on SmolLM2"):

    env_kwargs.tasks=examples.calc_agent_tasks:tasks

``train/i`` and ``valid/i`` are calc-tools' tasks of the same ids (``agentrl.envs.calc_tools.problem``), so an
evaluation of the first 60 ``valid`` tasks reads the same 60 expressions (20 per level) as calc-tools' does.
"""
from agentrl.envs.calc_tools import problem

TRAIN, VALID = 2000, 200  # calc-tools has 10,000 train tasks; 2,000 are more than a short run draws


def tasks() -> list[dict]:
    out = []
    for split, n in (("train", TRAIN), ("valid", VALID)):
        for i in range(n):
            expression, answer, level = problem(split, i)
            out.append({"split": split, "category": level, "expression": expression, "answer": answer})
    return out
