"""Run by tests/test_rank_failure.py under `torchrun --nproc_per_node=2`: a run driven from Python as the README
shows it (API_FORM=with: ``with Trainer.from_config(cfg) as t: t.train()``; plain: ``t.train()`` alone), on
DeepSpeed ranks, with rank FAIL_RANK running out of memory inside its first learner step (the patch of
tests/learner_failure_worker.py). The arguments are the config's overrides."""
import os
import sys

import agentrl
from tests import learner_failure_worker  # noqa: F401  (patches DeepSpeedEngine.step)

cfg = agentrl.load_config("grpo", env="bandit", overrides=sys.argv[1:])
if os.environ["API_FORM"] == "with":
    with agentrl.Trainer.from_config(cfg) as t:
        t.train()
else:
    t = agentrl.Trainer.from_config(cfg)
    t.train()
    t.close()
