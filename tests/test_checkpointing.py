"""model.gradient_checkpointing: the backward pass recomputes each decoder layer, and the losses and gradients
are those of the plain pass (policy, LoRA, separate critic; torch and DeepSpeed engines)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from agentrl.algos.losses import value_loss
from agentrl.learner.batch import collate, turn_sample
from agentrl.learner.engine import EngineConfig, LoraSettings, OptimConfig, TorchEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batch(seed=0, n=5):
    """Rows sharing a system prompt (the shared-prefix pass, which checkpointing must turn off) of mixed lengths."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(4, 300, (12,), generator=g).tolist()
    rows = []
    for i in range(n):
        prompt = system + torch.randint(4, 300, (3 + i,), generator=g).tolist()
        gen = torch.randint(4, 300, (2 + i % 3,), generator=g).tolist()
        rows.append(turn_sample(prompt, gen, [-5.0] * len(gen), 1.0 if i % 2 else -0.5))
    return collate(rows, pad_id=0)


def _loss(mb, out):
    pg = -(out["logp"] * mb.advantages * mb.loss_mask).sum() / mb.loss_mask.sum()
    if "values" in out:
        zero = torch.zeros_like(mb.advantages)
        pg = pg + value_loss(out["values"], zero, mb.advantages, mb.loss_mask, clip=None)
    return pg, {}


def _grads(tiny_model_dir, checkpointing, **cfg):
    eng = TorchEngine(tiny_model_dir, EngineConfig(optim=OptimConfig(lr=1e-3), token_budget=60,
                                                   gradient_checkpointing=checkpointing, **cfg))
    layer = (eng.model.get_base_model() if cfg.get("lora") else eng.model).model.layers[0]
    calls = []
    layer.mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    eng._train_mode(True)
    stats = eng.backward(_batch(), _loss, need_values=cfg.get("value_head", False))
    named = list(eng.model.named_parameters()) + \
        ([("critic." + n, p) for n, p in eng.critic.named_parameters()] if eng.critic is not None else [])
    grads = {n: p.grad.clone() for n, p in named if p.grad is not None}
    return stats, grads, len(calls) / stats["micro_batches"]


@pytest.mark.parametrize("cfg", [{}, {"lora": LoraSettings(r=4, alpha=8)},
                                 {"value_head": True, "critic": "separate"}], ids=["full", "lora", "critic"])
def test_checkpointing_gives_the_same_losses_and_gradients(tiny_model_dir, cfg):
    plain_stats, plain, plain_calls = _grads(tiny_model_dir, False, **cfg)
    ckpt_stats, ckpt, ckpt_calls = _grads(tiny_model_dir, True, **cfg)
    assert plain_calls == 1 and ckpt_calls == 2  # each layer ran again in the backward pass
    assert ckpt_stats["loss"] == pytest.approx(plain_stats["loss"], rel=1e-5)
    assert plain and ckpt.keys() == plain.keys()
    if "critic" in cfg:
        assert any(n.startswith("critic.backbone") for n in plain)  # the critic's layers took gradients too
    for n in plain:
        assert torch.allclose(ckpt[n], plain[n], atol=1e-6, rtol=1e-4), n


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpointing_under_deepspeed_trains_as_without(tiny_model_dir, tmp_path):
    """One ZeRO-3 rank (gloo), separate critic: the same losses over three steps with and without."""
    code = (
        "import json, sys\n"
        "from agentrl.learner.deepspeed_engine import DeepSpeedEngine\n"
        "from agentrl.learner.engine import EngineConfig, OptimConfig\n"
        "from tests.test_checkpointing import _batch, _loss\n"
        "out = {}\n"
        "for ckpt in (False, True):\n"
        "    e = DeepSpeedEngine(sys.argv[1], EngineConfig(optim=OptimConfig(lr=1e-3), token_budget=60,\n"
        "        value_head=True, critic='separate', gradient_checkpointing=ckpt))\n"
        "    layer = e.ds.module.policy.model.layers[0]\n"
        "    calls = []\n"
        "    layer.mlp.register_forward_pre_hook(lambda *a: calls.append(1))\n"
        "    steps = [e.step(_batch(k), _loss, need_values=True) for k in range(3)]\n"
        "    out[str(ckpt)] = dict(loss=[s['loss'] for s in steps], gn=[s['grad_norm'] for s in steps],\n"
        "                          cgn=[s['critic_grad_norm'] for s in steps],\n"
        "                          calls=len(calls) / sum(s['micro_batches'] for s in steps))\n"
        "    e.close()\n"
        "print('RESULT', json.dumps(out))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir)], capture_output=True, text=True,
                          env=env, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT ", 1)[1])
    plain, ckpt = res["False"], res["True"]
    assert plain["calls"] == 1 and ckpt["calls"] == 2
    for key in ("loss", "gn", "cgn"):
        assert ckpt[key] == pytest.approx(plain[key], rel=1e-4), key
