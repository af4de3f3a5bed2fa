"""Run by tests/test_rank_failure.py under `torchrun --nproc_per_node=2`: the CLI's `train` on DeepSpeed ranks,
with rank FAIL_RANK running out of memory inside its first learner step, after its first micro-batch's
forward pass (the other rank is then inside ZeRO-3's collectives). The time of the error goes to FAIL_STAMP."""
import os
import sys
import time

import torch

from agentrl.cli import main
from agentrl.learner import deepspeed_engine

_step, _calls = deepspeed_engine.DeepSpeedEngine.step, [0]


def step(self, batch, loss_fn, *args, **kwargs):
    _calls[0] += 1
    if os.environ.get("RANK") != os.environ["FAIL_RANK"] or _calls[0] != 1:
        return _step(self, batch, loss_fn, *args, **kwargs)

    def failing(mb, out):
        with open(os.environ["FAIL_STAMP"], "w") as f:
            f.write(str(time.time()))
        raise torch.OutOfMemoryError("CPU out of memory (injected by the test)")

    return _step(self, batch, failing, *args, **kwargs)


deepspeed_engine.DeepSpeedEngine.step = step
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
