"""The separate critic (issue 73): its own network and optimizer, so the value loss moves no policy weight;
saved and resumed with the checkpoint; on two DeepSpeed ranks, a PPO run resumed from a checkpoint repeats
the uninterrupted run's numbers."""
import pytest
import torch

from agentrl.algos.losses import value_loss
from agentrl.learner.batch import collate
from agentrl.learner.engine import EngineConfig, OptimConfig, TorchEngine


def value_batch(pad_id):
    """The learner tests' turn samples with a value target (+1 / -1) at each one's last prompt token."""
    from tests.test_learner import _samples

    samples = _samples(n=6, seed=4)
    for s in samples:
        first = s.loss_mask.index(1)
        s.returns, s.old_values, s.value_mask = [0.0] * len(s.ids), [0.0] * len(s.ids), [0] * len(s.ids)
        s.returns[first], s.value_mask[first] = s.advantages[first], 1
    return collate(samples, pad_id)


def value_only(mb, out):
    vl = value_loss(out["values"], mb.old_values, mb.returns, mb.value_mask, 0.2)
    return vl, {"value_loss": float(vl.detach())}


def engine(model_dir, critic, **kw):
    return TorchEngine(model_dir, EngineConfig(optim=OptimConfig(lr=1e-2), value_head=True, critic=critic,
                                               token_budget=100_000, **kw))


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_a_separate_critics_value_loss_changes_no_policy_weight(tiny_model_dir):
    eng = engine(tiny_model_dir, "separate")
    assert eng.value_head is None and eng.critic is not None
    # the critic starts from the policy's transformer (no LM head) and a zero value head
    policy_dec = eng.model.get_decoder().state_dict()
    assert all(torch.equal(v, policy_dec[k]) for k, v in eng.critic.backbone.state_dict().items())
    before, critic_before = snapshot(eng.model), snapshot(eng.critic)
    b = value_batch(eng.pad_id)
    stats = eng.step(b, value_only, need_values=True)
    assert stats["critic_grad_norm"] > 0
    after = snapshot(eng.model)
    assert all(torch.equal(before[k], after[k]) for k in before), "the value loss moved a policy weight"
    assert any(not torch.equal(critic_before[k], v) for k, v in snapshot(eng.critic).items())
    # and the values it now reads are closer to the targets
    assert eng.step(b, value_only, need_values=True)["value_loss"] < stats["value_loss"]

    # the shared value head, by contrast, trains the policy's decoder with the value loss
    shared = engine(tiny_model_dir, "shared")
    before = snapshot(shared.model)
    shared.step(value_batch(shared.pad_id), value_only, need_values=True)  # the zero head: its first step moves it
    shared.step(value_batch(shared.pad_id), value_only, need_values=True)
    after = snapshot(shared.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_critic_has_its_own_lr_and_resumes_from_the_checkpoint(tiny_model_dir, tmp_path):
    eng = engine(tiny_model_dir, "separate", critic_lr=3e-3)
    assert eng.critic_optimizer.param_groups[0]["lr"] == 3e-3 and eng.optimizer.param_groups[0]["lr"] == 1e-2
    b = value_batch(eng.pad_id)
    eng.step(b, value_only, need_values=True)
    eng.save(tmp_path / "ck")
    assert (tmp_path / "ck" / "critic.pt").is_file()  # inside the step folder, under its manifest
    nxt = eng.step(b, value_only, need_values=True)["value_loss"]
    again = engine(tiny_model_dir, "separate", critic_lr=3e-3)
    again.load(tmp_path / "ck")
    assert again.step(b, value_only, need_values=True)["value_loss"] == pytest.approx(nxt, rel=1e-6)
    shared = engine(tiny_model_dir, "shared")
    shared.save(tmp_path / "shared")
    with pytest.raises(ValueError, match="algo.critic=shared"):
        engine(tiny_model_dir, "separate").load(tmp_path / "shared")


def test_ppo_family_recipes_default_to_a_separate_critic():
    from agentrl import load_config

    for recipe in ("ppo", "starpo_ppo", "starpo_s"):
        cfg = load_config(recipe, env="sokoban")
        assert cfg.algo.critic == "separate", recipe
    assert load_config("ppo", env="sokoban", overrides=["algo.critic=shared"]).algo.critic == "shared"


def test_starpo_s_prints_a_critic_based_estimator(capsys):
    from agentrl.cli import main

    try:
        code = main(["train", "starpo_s", "--print-config"])
    except SystemExit as e:
        code = e.code
    assert not code
    out = capsys.readouterr().out
    assert "estimator: gae_token" in out and "critic: separate" in out
    assert "- variance" in out and "kl: none" in out and "eps_high: 0.28" in out


# Two DeepSpeed ranks: PPO (turn-level GAE) with its separate critic sharded like the policy. A run of 3 steps,
# and the same run stopped after 2 and resumed to 3: the third step's numbers must be the same.
PPO = ["train", "ppo", "--env", "sokoban", "trainer.engine=deepspeed", "sft.enabled=false", "eval.tasks=0",
       "rollout.groups=4", "rollout.slots=4", "rollout.max_turns=2", "rollout.max_new_tokens=8",
       "algo.reward=env_return", "rollout.format_penalty=-0.1", "trainer.tensorboard=false",
       "trainer.checkpoint_every=1", "optim.critic_lr=1e-3", "algo.mini_batches=1"]


@pytest.mark.slow
@pytest.mark.extended  # minutes; make test keeps the DeepSpeed critic's step and the 2-rank killed-run resume
@pytest.mark.timeout(1500)
def test_ppo_with_a_separate_critic_on_two_deepspeed_ranks_resumes_exactly(sokoban_sft_model_dir, tmp_path):
    from tests.test_multirank import launch, rows

    args = PPO + [f"model.name={sokoban_sft_model_dir}"]
    whole = launch(2, args + ["trainer.steps=3", f"trainer.out_dir={tmp_path / 'whole'}"], timeout=700)
    assert whole.returncode == 0, whole.stdout[-2000:] + whole.stderr[-3000:]
    part = tmp_path / "part"
    first = launch(2, args + ["trainer.steps=2", f"trainer.out_dir={part}"], timeout=700)
    assert first.returncode == 0, first.stderr[-3000:]
    ck = part / "checkpoints" / "step-000002"
    assert (ck / "critic").is_dir() and any((ck / "critic").rglob("*optim_states.pt"))  # sharded, in the step folder
    resumed = launch(2, args + ["trainer.steps=3", f"trainer.out_dir={part}"], timeout=700)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    a, b = rows(tmp_path / "whole"), rows(part)
    assert "value_loss" in a[3] and a[3].get("critic_grad_norm", 0) > 0
    for k in ("loss", "value_loss", "critic_grad_norm", "grad_norm", "reward_mean", "success"):
        assert b[3][k] == pytest.approx(a[3][k], rel=1e-4, abs=1e-6), k
    assert (part / "final.json").is_file()


def test_a_critic_path_that_is_no_model_folder_is_refused_before_any_work(tmp_path):
    from agentrl import load_config
    from agentrl.config import ConfigError

    with pytest.raises(ConfigError, match="'algo.critic_path'.*not a model folder") as e:
        load_config("ppo", env="sokoban", overrides=[f"algo.critic_path={tmp_path / 'none'}"])
    assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deepspeed_critic_starts_from_the_policy_and_a_value_step_leaves_the_policy(tiny_model_dir):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, str(root / "tests" / "critic_ds_worker.py"), str(tiny_model_dir)],
                         capture_output=True, text=True, env=env, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1])
    # after the policy moved, critic_from_policy copies it: the weights and ZeRO-3's fp32 master copy of them
    assert r["differs_before"] and r["weights_equal"] and r["master_equal"]
    assert r["critic_grad_norm"] > 0 and r["critic_moved"] and r["policy_unchanged"]
