"""Run by scripts/rehearse.sh (failures) in place of `-m agentrl.cli`: the CLI, with node 1 failing where
AGENTRL_REHEARSE_FAULT says. ``before-group``: every rank of node 1 raises before the process group exists
(as a refused config or a missing package would); ``learner-step``: rank 1 raises in its first learner step
(the others are then inside ZeRO-3's collectives). Node 0 must stop within seconds with node 1's message."""
import os
import sys

from agentrl.cli import main

FAULT = os.environ.get("AGENTRL_REHEARSE_FAULT", "")
ON_NODE_1 = os.environ.get("GROUP_RANK", os.environ.get("CROSS_RANK", "0")) == "1"

if __name__ != "__main__":  # a spawned worker of the process pool re-imports this module: nothing to run
    pass
elif FAULT == "before-group" and ON_NODE_1:
    from agentrl import dist

    def init(device, timeout_s=1800.0):
        raise RuntimeError(f"node 1 failed before the process group existed (rank {dist.rank()}, injected)")

    dist.init = init
elif FAULT == "learner-step" and os.environ.get("RANK") == "1":
    from agentrl.learner import deepspeed_engine

    def step(self, *args, **kwargs):
        raise RuntimeError("rank 1 failed in its learner step (injected)")

    deepspeed_engine.DeepSpeedEngine.step = step

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
