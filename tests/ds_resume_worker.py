"""Run by tests/test_deepspeed.py under torchrun (DS_ACCELERATOR=cpu): a ZeRO-3 run saved on one number of
ranks and resumed on another. Phases: ``a`` (2 ranks) steps 1-2, saves, steps 3-5 on (the uninterrupted
run); ``b`` (1 rank) resumes a's save, steps 3-4, saves; ``c`` (2 ranks) resumes b's save, step 5. Each
rank writes its losses to OUT/PHASE-rankR.json."""
import json
import os
import sys

from agentrl.learner.deepspeed_engine import DeepSpeedEngine
from agentrl.learner.engine import EngineConfig, OptimConfig
from tests.ds_zero3_worker import data, loss_fn


def main(phase, model_dir, out_dir):
    eng = DeepSpeedEngine(model_dir, EngineConfig(optim=OptimConfig(lr=1e-3, warmup_steps=4), token_budget=100_000))
    b = data(eng.pad_id)
    losses = {}
    if phase == "a":
        for _ in (1, 2):
            eng.step(b, loss_fn)
        eng.save(f"{out_dir}/a")
        todo = (3, 4, 5)
    else:
        eng.load(f"{out_dir}/{'a' if phase == 'b' else 'b'}")
        todo = (3, 4) if phase == "b" else (5,)
    for s in todo:
        st = eng.step(b, loss_fn)
        losses[s] = [st["loss"], st["grad_norm"], st["lr"]]
    if phase == "b":
        eng.save(f"{out_dir}/b")
    with open(f"{out_dir}/{phase}-rank{eng.rank}.json", "w") as f:
        json.dump(dict(losses=losses, world=eng.world, step=eng.global_step), f)
    eng.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see ds_zero3_worker.py
