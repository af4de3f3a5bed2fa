"""Run by tests/test_multirank.py under `torchrun --nproc_per_node=2`: the CLI's `train`, with rank 1's
third rollout call failing (an env or server error on one rank only). Every rank must stop with the error
instead of waiting for rank 1 at the gather until the process group's timeout."""
import os
import sys

from agentrl.cli import main
from agentrl.rollout import engine

_run, _calls = engine.RolloutEngine.run, [0]


def run(self, starts, streams=None):
    _calls[0] += 1
    if os.environ.get("RANK") == "1" and _calls[0] == 3:
        raise RuntimeError("the env exploded on rank 1")
    return _run(self, starts, streams)


engine.RolloutEngine.run = run
sys.exit(main(sys.argv[1:]))
