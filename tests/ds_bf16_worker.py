"""Run by tests/test_deepspeed_precision.py in a process of its own (DS_ACCELERATOR=cpu): a PPO run (a separate
critic) and its KL reference built through ``Trainer.from_config`` under configs/deepspeed/zero3.json with the
default model.dtype (float32); writes what each engine holds (report.json)."""
import json
import sys

import torch

from agentrl import Trainer
from agentrl.config_loader import load_config
from tests.ds_zero3_worker import loss_fn, samples
from tests.test_trainer import small


def dtypes(module):
    return sorted({str(p.ds_tensor.dtype if hasattr(p, "ds_tensor") else p.dtype) for p in module.parameters()})


def main(model_dir, out_dir):
    from agentrl.learner.batch import collate

    cfg = load_config("ppo", env="sokoban", overrides=small(f"{out_dir}/run", model_dir, "trainer.engine=deepspeed",
                                                            "trainer.deepspeed_config=configs/deepspeed/zero3.json",
                                                            "rollout.slots=1"))
    assert cfg.model.dtype == "float32"
    trainer = Trainer.from_config(cfg)
    eng = trainer.engine
    eng.set_reference(trainer.model_dir)
    opt = eng.optimizer
    report = dict(
        policy=dtypes(eng.ds.module), critic=dtypes(eng.critic_ds.module), reference=dtypes(eng.reference.module),
        partitioned=all(hasattr(p, "ds_tensor") for p in eng.ds.module.parameters()),
        bf16_enabled=eng.ds.bfloat16_enabled(),
        master=sorted({str(t.dtype) for t in opt.fp32_partitioned_groups_flat}),
        adam=sorted({str(v.dtype) for s in opt.optimizer.state.values() for v in s.values()
                     if torch.is_tensor(v) and v.dim() > 0}))
    batch = collate(samples(), pad_id=eng.pad_id)
    logp, values = eng.logprobs(batch, values=True)
    report.update(logp=str(logp.dtype), values=str(values.dtype), ref=str(eng.ref_logprobs(batch).dtype))
    stats = eng.step(batch, loss_fn)  # one step: the fp32 master weights move, the bf16 shards follow
    report.update(loss=stats["loss"], finite=bool(torch.isfinite(torch.tensor(stats["loss"]))),
                  adam=sorted({str(v.dtype) for s in opt.optimizer.state.values() for v in s.values()
                               if torch.is_tensor(v) and v.dim() > 0}))
    eng.export_weights(f"{out_dir}/as_held")  # the shards' dtype, said so in its config
    eng.export_weights(f"{out_dir}/fp32", "float32")  # from the optimizer's fp32 master weights
    from deepspeed.utils import safe_get_full_fp32_param

    name, p = next((n, p) for n, p in eng.ds.module.policy.named_parameters() if n.endswith("q_proj.weight"))
    torch.save({name: safe_get_full_fp32_param(p).clone()}, f"{out_dir}/master.pt")
    (__import__("pathlib").Path(out_dir) / "report.json").write_text(json.dumps(report))
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
