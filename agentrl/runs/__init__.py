"""A run's records: the rollouts each step wrote (``records``) and reading a run folder back (``open``).

    import agentrl.runs
    run = agentrl.runs.open("runs/grpo-sokoban-s0")
    for ep in run.step(run.steps()[-1]).episodes:
        print(ep["task_id"], ep["won"], [t["actions"] for t in ep["turns"]])
"""
from agentrl.runs.reader import RunRecords, StepRecords, open_run

open = open_run  # noqa: A001  (agentrl.runs.open(path), as the docs spell it)

__all__ = ["RunRecords", "StepRecords", "open", "open_run"]
