"""Run by tests/test_deepspeed.py under `torchrun --nproc_per_node=2` with DS_ACCELERATOR=cpu."""
import json
import os
import sys


from agentrl.algos.losses import Objective, ppo_objective
from agentrl.checkpoint import export_dtype
from agentrl.config import AlgoCfg
from agentrl.learner.batch import collate
from agentrl.learner.deepspeed_engine import DeepSpeedEngine
from agentrl.learner.engine import EngineConfig, OptimConfig
from agentrl.learner.optim_state import reset_optimizer_state


def samples():
    from tests.test_learner import _samples

    return _samples(n=8, seed=3)


def data(pad_id):
    """The whole batch, as one process collates it (the torch engine's reference run)."""
    return collate(samples(), pad_id=pad_id)


def loss_fn(mb, out):
    obj = Objective.of(AlgoCfg(eps_high=0.28))
    return ppo_objective(out["logp"], mb.old_logprobs, mb.advantages, mb.loss_mask, obj)


def main(model_dir, out_dir, steps):
    eng = DeepSpeedEngine(model_dir, EngineConfig(optim=OptimConfig(lr=1e-3, grad_clip=1.0), token_budget=100_000))
    from tests.test_token_batch import rank_batch

    b = rank_batch(samples(), eng.pad_id, eng.rank, eng.world)  # the other rank's rows unreadable
    losses = [eng.step(b, loss_fn)["loss"] for _ in range(steps)]
    reset_optimizer_state(eng)  # then one more step: it must move the shards as a fresh optimizer would
    losses.append(eng.step(b, loss_fn)["loss"])
    report = dict(rank=eng.rank, world=eng.world, partition=eng.partition_numel(), full=eng.full_numel(),
                  losses=losses)
    eng.export_weights(f"{out_dir}/exported")
    eng.export_weights(f"{out_dir}/exported_ckpt", export_dtype("deepspeed", eng.cfg))  # what a checkpoint holds
    with open(f"{out_dir}/rank{eng.rank}.json", "w") as f:
        json.dump(report, f)
    eng.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    # the report is written and the group left: skip static destructors, which rarely abort a rank under
    # load ("terminate called without an active exception", 1 run in ~10); the test checks the numbers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
