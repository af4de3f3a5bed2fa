"""Run by tests/test_critic.py in a process of its own (DS_ACCELERATOR=cpu): the separate critic as a ZeRO-3
engine. Prints one JSON line of what it saw."""
import json
import sys

import deepspeed
import torch
from deepspeed.utils import safe_get_full_fp32_param

from agentrl.algos.losses import Objective, ppo_objective
from agentrl.config import AlgoCfg
from agentrl.learner.batch import collate
from agentrl.learner.deepspeed_engine import DeepSpeedEngine
from agentrl.learner.engine import EngineConfig, OptimConfig
from tests.test_critic import value_batch, value_only
from tests.test_learner import _samples


def gathered(module, prefix=""):
    out = {}
    for n, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[n.removeprefix(prefix)] = p.data.clone()
    return out


def policy_loss(mb, out):
    return ppo_objective(out["logp"], mb.old_logprobs, mb.advantages, mb.loss_mask, Objective.of(AlgoCfg()))


def main(model_dir):
    eng = DeepSpeedEngine(model_dir, EngineConfig(optim=OptimConfig(lr=1e-2), value_head=True, critic="separate",
                                                  token_budget=100_000))
    eng.step(collate(_samples(n=6, seed=3), eng.pad_id), policy_loss)  # the policy moves (as in SFT), not the critic
    policy = gathered(eng.ds.module.policy, "model.")
    critic = eng.critic_ds.module.backbone
    report = dict(differs_before=any(not torch.equal(v, policy[k]) for k, v in gathered(critic).items()))
    eng.critic_from_policy()
    report["weights_equal"] = all(torch.equal(v, policy[k]) for k, v in gathered(critic).items())
    master = {n: safe_get_full_fp32_param(p) for n, p in critic.named_parameters()}
    report["master_equal"] = all(torch.equal(v, policy[k]) for k, v in master.items())
    stats = [eng.step(value_batch(eng.pad_id), value_only, need_values=True) for _ in range(2)]
    report["critic_grad_norm"] = stats[-1]["critic_grad_norm"]
    after = gathered(eng.ds.module.policy, "model.")
    report["policy_unchanged"] = all(torch.equal(v, policy[k]) for k, v in after.items())
    report["critic_moved"] = any(not torch.equal(v, policy[k]) for k, v in gathered(critic).items())
    print(json.dumps(report), flush=True)
    eng.close()


if __name__ == "__main__":
    main(sys.argv[1])
