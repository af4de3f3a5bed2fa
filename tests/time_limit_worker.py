"""Run by tests/test_multirank.py under `torchrun --nproc_per_node=2`: trainer.time_limit_s when the
ranks' clocks disagree. In each case one rank's trainer believes it started almost the whole limit ago;
rank 0's clock must decide for both, so that they stop after the same step (or train on together)
instead of one waiting forever in a collective the other never joins. Each rank writes rank{r}.json."""
import gc
import sys
import time

from agentrl import Trainer, dist
from agentrl.config_loader import load_config
from tests.ds_recipes_worker import report_and_leave
from tests.test_trainer import small


def main(model_dir, out_root):
    report = {}
    for late in (0, 1):  # the rank whose clock says the limit is (almost) used up
        cfg = load_config("grpo", env="sokoban", overrides=small(f"{out_root}/late{late}", model_dir, "trainer.steps=2",
                                                                  "trainer.engine=deepspeed", "sft.enabled=false",
                                                                  "eval.every=0", "trainer.time_limit_s=1000"))
        trainer = Trainer.from_config(cfg)
        if dist.rank() == late:
            trainer._t0 = time.monotonic() - 999.9
        final = trainer.train()
        report[f"late{late}"] = dict(step=trainer.step, evaluated="eval/success" in final)
        trainer.envs.close()  # not trainer.close(): the DeepSpeed engine's close ends the process group
        del trainer
        gc.collect()
    report_and_leave(out_root, report)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
