"""The torch learner engine: batching, accumulation, loss decrease, LoRA, value head, exact resume."""
import copy
import math
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from agentrl.algos.losses import Objective, ppo_objective, sft_loss, value_loss
from agentrl.config import AlgoCfg
from agentrl.config import SFTCfg
from agentrl.learner.batch import collate, episode_sample, micro_batches, turn_sample
from agentrl.learner.engine import EngineConfig, LoraSettings, OptimConfig, TorchEngine
from agentrl.types import Episode, SamplingParams, Turn


def _samples(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(4, 300, (5 + i,), generator=g).tolist()
        gen = torch.randint(4, 300, (3 + i % 3,), generator=g).tolist()
        out.append(turn_sample(prompt, gen, [-5.0] * len(gen), 1.0 if i % 2 else -1.0))
    return out


def test_turn_and_episode_samples_mask_only_generated_tokens():
    s = turn_sample([1, 2, 3], [7, 8], [-0.5, -0.25], 2.0)
    assert s.loss_mask == [0, 0, 0, 1, 1] and s.old_logprobs == [0, 0, 0, -0.5, -0.25] and s.advantages[-1] == 2.0
    b = collate([s], pad_id=0)
    assert b.loss_mask.tolist() == [[0, 0, 1, 1]]  # shifted onto target positions
    t1 = Turn([1, 2], [5, 6], [-1.0, -1.0], "", [], True, "", 0.0, False)
    t2 = Turn([1, 2, 5, 6, 9], [7], [-2.0], "", [], True, "", 1.0, True)
    ep = episode_sample(Episode("e", "t", 0, turns=[t1, t2]), [0.5, 1.5])
    assert ep.ids == [1, 2, 5, 6, 9, 7] and ep.loss_mask == [0, 0, 1, 1, 0, 1]
    assert ep.advantages == [0, 0, 0.5, 0.5, 0, 1.5] and ep.old_logprobs == [0, 0, -1, -1, 0, -2]
    bad = Turn([3, 3], [7], [-2.0], "", [], True, "", 1.0, True)
    with pytest.raises(ValueError, match="not nested"):
        episode_sample(Episode("e", "t", 0, turns=[t1, bad]), [0.0, 0.0])


def test_micro_batches_respect_the_token_budget():
    b = collate(_samples(), pad_id=0)
    parts = micro_batches(b, token_budget=30)
    assert sorted(i for p in parts for i in p) == list(range(6))
    lengths = b.attention_mask.sum(-1).tolist()
    assert all(max(lengths[i] for i in p) * len(p) <= 30 or len(p) == 1 for p in parts)


def _ppo(mb, out):
    obj = Objective.of(AlgoCfg(eps_high=0.28))
    return ppo_objective(out["logp"], mb.old_logprobs, mb.advantages, mb.loss_mask, obj)


def test_accumulation_equals_one_big_batch(tiny_model_dir):
    b = collate(_samples(), pad_id=0)
    cfg = lambda budget: EngineConfig(optim=OptimConfig(lr=1e-3, grad_clip=None), token_budget=budget)  # noqa: E731
    big, small = TorchEngine(tiny_model_dir, cfg(10_000)), TorchEngine(tiny_model_dir, cfg(25))
    s_big, s_small = big.backward(b, _ppo), small.backward(b, _ppo)
    assert s_small["micro_batches"] > 1 and s_big["micro_batches"] == 1
    assert s_small["loss"] == pytest.approx(s_big["loss"], abs=1e-6)
    # the same gradient (Adam's first update is ~lr * sign(g), too sensitive to compare parameters)
    for p, q in zip(big.model.parameters(), small.model.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4)


def test_a_micro_batch_out_of_memory_names_the_token_budget_to_set(tiny_model_dir, monkeypatch):
    from agentrl.learner.engine import LearnerOutOfMemory

    eng = TorchEngine(tiny_model_dir, EngineConfig(optim=OptimConfig(lr=1e-3), token_budget=30))
    b = collate(_samples(), pad_id=eng.pad_id)

    def too_big(mb, *a, **k):  # what the CUDA allocator raises when a micro-batch does not fit
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(eng, "forward", too_big)
    with pytest.raises(LearnerOutOfMemory, match=r"rows of up to \d+ tokens \(optim.token_budget=30\): set "
                       r"optim.token_budget=15 .*torch: CUDA out of memory"):
        eng.step(b, _ppo)
    eng.cfg.token_budget = 1  # every row alone: a smaller budget cannot help
    with pytest.raises(LearnerOutOfMemory, match="a micro-batch of 1 row of .* one row is already too long"):
        eng.step(b, _ppo)


def test_sft_steps_reduce_the_loss(tiny_model_dir):
    eng = TorchEngine(tiny_model_dir, EngineConfig(optim=OptimConfig(lr=3e-3)))
    b = collate(_samples(), pad_id=eng.pad_id)
    losses = [eng.step(b, lambda mb, out: (sft_loss(out["logp"], mb.loss_mask), {}))["loss"] for _ in range(5)]
    assert losses[-1] < losses[0] * 0.9


def test_lora_trains_only_adapters_and_exports_merged(tiny_model_dir, tmp_path):
    from agentrl.learner.models import load_model

    eng = TorchEngine(tiny_model_dir, EngineConfig(optim=OptimConfig(lr=1e-2), lora=LoraSettings(r=4, alpha=8)))
    names = [n for n, p in eng.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    b = collate(_samples(), pad_id=eng.pad_id)
    for _ in range(2):
        eng.step(b, lambda mb, out: (sft_loss(out["logp"], mb.loss_mask), {}))
    folder = eng.export_weights(tmp_path / "merged")
    merged = load_model(folder)
    assert torch.allclose(eng.logprobs(b), TorchEngine(folder).logprobs(b), atol=1e-5)
    assert not any("lora" in k for k in merged.state_dict())
    assert (eng.export_adapter(tmp_path / "adapter") / "adapter_config.json").exists()


def test_value_head_learns_returns(tiny_model_dir):
    eng = TorchEngine(tiny_model_dir, EngineConfig(optim=OptimConfig(lr=1e-2), value_head=True, critic="shared"))
    samples = _samples()
    for s in samples:
        s.returns = [1.0] * len(s.ids)
        s.old_values = [0.0] * len(s.ids)
    b = collate(samples, pad_id=eng.pad_id)

    def loss(mb, out):
        return value_loss(out["values"], mb.old_values, mb.returns, mb.loss_mask, clip=None), {}

    first = eng.step(b, loss, need_values=True)["loss"]
    for _ in range(10):
        last = eng.step(b, loss, need_values=True)["loss"]
    assert first == pytest.approx(0.5) and last < 0.2


RESUME = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {root!r})
    from tests.test_learner import run_steps
    run_steps({model!r}, {steps}, save_to={save!r})
    os.kill(os.getpid(), signal.SIGKILL)  # die hard right after the checkpoint
""")


def run_steps(model_dir, steps, save_to=None, load_from=None):
    """Train with a loss that draws random numbers (Clip-Cov), so RNG state matters for resuming."""
    torch.manual_seed(123)
    eng = TorchEngine(model_dir, EngineConfig(optim=OptimConfig(lr=3e-3, warmup_steps=3)))
    if load_from:
        eng.load(load_from)
    b = collate(_samples(seed=1), pad_id=eng.pad_id)

    def loss(mb, out):
        return ppo_objective(out["logp"], mb.old_logprobs, mb.advantages, mb.loss_mask,
                             Objective.of(AlgoCfg(clip_cov_ratio=0.3), clip_cov_bounds=(-1e9, 1e9)))

    losses = [eng.step(b, loss)["loss"] for _ in range(steps)]
    if save_to:
        eng.save(save_to)
    return losses


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_save_kill_resume_gives_the_same_next_loss(tiny_model_dir, tmp_path):
    straight = run_steps(tiny_model_dir, 3)
    ckpt = tmp_path / "ckpt"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", RESUME.format(root=root, model=str(tiny_model_dir), steps=2,
                                                               save=str(ckpt))], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr  # killed, not exited
    assert (ckpt / "model" / "config.json").exists()
    resumed = run_steps(tiny_model_dir, 1, load_from=ckpt)
    assert resumed[0] == pytest.approx(straight[2], abs=1e-6)


def test_lora_checkpoint_holds_the_adapters_and_resumes_exactly(tiny_model_dir, tmp_path):
    """A LoRA run's engine.pt keeps the trained adapters and their optimizer state, not the frozen base
    (rebuilt from the model folder on resume): far smaller, and the next step is the same."""
    def engine():
        torch.manual_seed(0)
        return TorchEngine(tiny_model_dir, EngineConfig(optim=OptimConfig(lr=3e-3), lora=LoraSettings(
            r=4, alpha=8, target_modules=["q_proj", "v_proj"])))

    b = collate(_samples(seed=1), pad_id=0)

    def loss(mb, out):
        return ppo_objective(out["logp"], mb.old_logprobs, mb.advantages, mb.loss_mask, Objective.of(AlgoCfg()))

    eng = engine()
    straight = [eng.step(b, loss)["loss"] for _ in range(3)]
    eng = engine()
    [eng.step(b, loss) for _ in range(2)]
    eng.save(tmp_path / "ckpt")
    saved = torch.load(tmp_path / "ckpt" / "engine.pt", weights_only=True)["model"]
    assert saved and all("lora_" in k for k in saved)
    resumed = engine()
    resumed.load(tmp_path / "ckpt")
    assert resumed.step(b, loss)["loss"] == pytest.approx(straight[2], abs=1e-6)
    other = TorchEngine(tiny_model_dir, EngineConfig(lora=LoraSettings(r=4, alpha=8, target_modules=["o_proj"])))
    with pytest.raises(ValueError, match="lacks adapter weights"):
        other.load(tmp_path / "ckpt")


def test_sft_learning_rate_survives_the_scheduler(tiny_model_dir):
    """fit_sft's own lr must hold for every step, not just the first (LambdaLR resets group lrs)."""
    from agentrl.learner.batch import collate
    from agentrl.learner.lr import restore_lr, set_lr

    eng = TorchEngine(tiny_model_dir, EngineConfig(optim=OptimConfig(lr=1e-4)))
    saved = set_lr(eng, 3e-3)
    b = collate(_samples(n=2, seed=1), pad_id=eng.pad_id)
    lrs = [eng.step(b, lambda mb, out: (-(out["logp"] * mb.loss_mask).sum() / mb.loss_mask.sum(), {}))["lr"]
           for _ in range(3)]
    assert lrs == pytest.approx([3e-3] * 3)
    restore_lr(eng, saved)
    assert eng.step(b, lambda mb, out: ((out["logp"] * mb.loss_mask).sum() * 0, {}))["lr"] == pytest.approx(1e-4)


def test_an_lr_set_mid_warm_up_keeps_the_warm_up(tiny_model_dir):
    """optim.warmup_steps=4, then fit_sft/the RL loop set their own lr: the steps still ramp up
    (x 1/4, 2/4, 3/4, 1), the step right after the set included, and an lr set after it is plain."""
    from agentrl.learner.batch import collate
    from agentrl.learner.lr import set_lr

    eng = TorchEngine(tiny_model_dir, EngineConfig(optim=OptimConfig(lr=1e-4, warmup_steps=4)))
    b = collate(_samples(n=2, seed=1), pad_id=eng.pad_id)

    def step() -> float:  # the lr this step runs at, and the one the engine reports
        lr = eng.optimizer.param_groups[0]["lr"]
        assert eng.step(b, lambda mb, out: ((out["logp"] * mb.loss_mask).sum() * 0, {}))["lr"] == lr
        return lr

    set_lr(eng, 2e-3)
    lrs = [step()]
    set_lr(eng, 2e-3)  # the RL loop sets its lr before every RL step
    lrs += [step() for _ in range(4)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1.5e-3, 2e-3, 2e-3])


@pytest.mark.parametrize("lora", [False, True])
def test_targets_only_forward_matches_the_full_vocabulary_pass(tiny_model_dir, lora):
    """Projecting to the vocabulary only at target positions gives the same log-probs, entropies and
    gradients there as the full pass."""
    from agentrl.learner.engine import forward_batch

    eng = TorchEngine(tiny_model_dir, EngineConfig(lora=LoraSettings(r=4, alpha=8) if lora else None))
    b = collate(_samples(), pad_id=eng.pad_id)
    m = b.loss_mask.bool()
    outs, grads = [], []
    for fast in (False, True):
        eng.model.zero_grad()
        out = forward_batch(eng.model, None, b, 0.7, need_entropy=True, targets_only=fast)
        (out["logp"][m].sum() + out["entropy"][m].sum()).backward()
        outs.append(out)
        grads.append([p.grad.clone() for p in eng.model.parameters() if p.grad is not None])
    assert torch.allclose(outs[0]["logp"][m], outs[1]["logp"][m], atol=1e-5)
    assert torch.allclose(outs[0]["entropy"][m], outs[1]["entropy"][m], atol=1e-5)
    assert (outs[1]["logp"][~m] == 0).all()
    assert all(torch.allclose(g, h, atol=1e-5, rtol=1e-4) for g, h in zip(*grads))


@pytest.mark.parametrize("lora", [False, True])
def test_shared_prefix_pass_matches_the_plain_pass(tiny_model_dir, lora, monkeypatch):
    """Rows with a common system prompt run it once; log-probs, entropies and gradients equal the pass
    that runs every row in full (rows of different lengths, right padding, a target on the first token
    after the prefix)."""
    from agentrl.learner import engine as E, hidden as H

    eng = TorchEngine(tiny_model_dir, EngineConfig(lora=LoraSettings(r=4, alpha=8) if lora else None))
    g = torch.Generator().manual_seed(3)
    system = torch.randint(4, 300, (20,), generator=g).tolist()
    samples = _samples()
    samples = [turn_sample(system + s.ids[:4 + i], s.ids[4 + i:], [-5.0] * (len(s.ids) - 4 - i), s.advantages[-1])
               for i, s in enumerate(samples)]
    samples.append(turn_sample(system, [7, 8, 9], [-5.0] * 3, 1.0))  # generation starts right after the prefix
    b = collate(samples, pad_id=eng.pad_id)
    assert E.batch_prefix_len(b.input_ids, b.attention_mask) == 20
    passes = []
    for shared in (False, True):
        monkeypatch.setattr(H, "batch_prefix_len", E.batch_prefix_len if shared else lambda ids, mask: 0)
        passes.append(_pass_with_grads(eng, b))
    _assert_passes_agree(b, *passes)


def _pass_with_grads(eng, b, **kw):
    """A pass's target log-probs and entropies (temperature 0.7), and the gradients of their sum."""
    from agentrl.learner import engine as E

    m = b.loss_mask.bool()
    eng.model.zero_grad()
    out = E.forward_batch(eng.model, None, b, 0.7, need_entropy=True, targets_only=True, **kw)
    (out["logp"][m].sum() + out["entropy"][m].sum()).backward()
    return out, [p.grad.clone() for p in eng.model.parameters() if p.grad is not None]


def _assert_passes_agree(b, first, second):
    m = b.loss_mask.bool()
    (a, ga), (c, gc) = first, second
    assert torch.allclose(a["logp"][m], c["logp"][m], atol=1e-5)
    assert torch.allclose(a["entropy"][m], c["entropy"][m], atol=1e-5)
    assert len(gc) == len(ga) > 0
    assert all(torch.allclose(g, h, atol=1e-5, rtol=1e-4) for g, h in zip(ga, gc))


@pytest.mark.parametrize("lora", [False, True])
def test_prefix_tree_pass_matches_the_plain_pass(tiny_model_dir, lora):
    """GRPO-shaped rows (a system prompt all share, 3 prompts each repeated for 3 completions, one prompt
    longer than the others): the prefix tree runs the system prompt once, each prompt once per group
    and the completions per row; log-probs, entropies and gradients equal the pass over every row in full."""
    from agentrl.prefix import prefix_levels

    eng = TorchEngine(tiny_model_dir, EngineConfig(lora=LoraSettings(r=4, alpha=8) if lora else None))
    g = torch.Generator().manual_seed(5)
    system = torch.randint(4, 300, (24,), generator=g).tolist()
    prompts = [system + torch.randint(4, 300, (n,), generator=g).tolist() for n in (20, 20, 26)]
    samples = []
    for p in prompts:
        for k in range(3):
            gen = torch.randint(4, 300, (3 + 2 * k,), generator=g).tolist()
            samples.append(turn_sample(p, gen, [-5.0] * len(gen), 1.0 if k else -1.0))
    b = collate(samples, pad_id=eng.pad_id)
    rows = [r[:n] for r, n in zip(b.input_ids.tolist(), b.attention_mask.sum(-1).tolist())]
    levels = prefix_levels(rows, b.input_ids.shape[1])
    assert [m for m, _ in levels][:2] == [24, 44]
    group = levels[1][1]  # the prompts' pass: one row a group
    assert group == [group[0]] * 3 + [group[3]] * 3 + [group[6]] * 3 and len(set(group)) == 3
    _assert_passes_agree(b, *(_pass_with_grads(eng, b, shared_prefix=tree, prefix_tree=tree) for tree in (False, True)))
    if not lora:  # a separate critic's values run the same tree
        from agentrl.learner.critic import load_critic

        critic = load_critic(tiny_model_dir)
        torch.nn.init.normal_(critic.head.v.weight)
        real = b.attention_mask[:, 1:].bool()
        with torch.no_grad():
            plain, tree = critic(b, prefix_tree=False), critic(b, prefix_tree=True)
        assert torch.allclose(plain[real], tree[real], atol=1e-5)


def test_prefix_levels_cut_where_rows_stop_sharing():
    """Passes end where the rows' shared tokens end, only where one saves more positions than its call costs,
    and leave every row a token of its own; rows with nothing in common get none."""
    from agentrl.prefix import prefix_levels

    system, a, b = list(range(100, 140)), [1] * 30, [2] * 30
    rows = [system + a + [7, 8], system + a + [9], system + b + [7], system + b + [8, 9]]
    assert prefix_levels(rows, 73) == [(40, [0, 0, 0, 0]), (70, [0, 0, 1, 1])]
    assert prefix_levels([system + [1], system + [2]], 41) == [(40, [0, 0])]
    assert prefix_levels([[1, 2, 3], [4, 5, 6]], 3) == []
    assert prefix_levels([system[:3] + [1], system[:3] + [2]], 4) == []  # 3 shared tokens: not worth a call
    assert prefix_levels([system, system], 40) == [(39, [0, 0])]  # identical rows: the last token per row


def test_sft_linear_schedule_decays_the_lr_to_zero_by_the_last_step(tiny_model_dir):
    """sft.schedule=linear: 2 passes x 3 batches run at lr x (1, 5/6, ..., 1/6); the engine's own lr is
    back afterwards."""
    from types import SimpleNamespace

    from agentrl.learner.lr import lr_factor
    from agentrl.sft import fit_sft

    assert lr_factor(0, 10, "cosine") == 1.0 and lr_factor(5, 10, "cosine") == pytest.approx(0.5)
    eng = TorchEngine(tiny_model_dir, EngineConfig(optim=OptimConfig(lr=1e-4)))
    lrs = []
    step = eng.step
    eng.step = lambda *a, **k: lrs.append(eng.optimizer.param_groups[0]["lr"]) or step(*a, **k)
    cfg = SimpleNamespace(trainer=SimpleNamespace(seed=0), sft=SFTCfg())  # real defaults: new sft keys need no edit
    trainer = SimpleNamespace(engine=eng, cfg=cfg,
                              sync_weights=lambda: None, echo=print)
    fit_sft(trainer, _samples(n=6), epochs=2, batch_size=2, lr=6e-3, schedule="linear")
    assert lrs == pytest.approx([6e-3 * (6 - k) / 6 for k in range(6)])
    del eng.step
    assert eng.step(collate(_samples(n=2), eng.pad_id), lambda mb, out: ((out["logp"] * 0).sum(), {}))["lr"] == \
        pytest.approx(1e-4)


def _recording_sft_trainer(model_dir):
    """A trainer stand-in for fit_sft whose optimizer steps and weight syncs are logged, in order, to ``events``."""
    from types import SimpleNamespace

    eng = TorchEngine(model_dir, EngineConfig(optim=OptimConfig(lr=1e-4)))
    events = []
    cfg = SimpleNamespace(trainer=SimpleNamespace(seed=0), sft=SFTCfg())  # real defaults: new sft keys need no edit
    trainer = SimpleNamespace(engine=eng, cfg=cfg,
                              sync_weights=lambda: events.append("sync"), echo=print)
    step = eng.step
    eng.step = lambda *a, **k: events.append("step") or step(*a, **k)
    return trainer, events


def test_sft_keeps_making_passes_while_asked_and_at_most_max_epochs(tiny_model_dir):
    """sft.max_epochs: keep_going is asked after pass `epochs` and each pass after it, with the generator
    synced first; a False stops there, and max_epochs caps the passes (the last one is still read)."""
    from agentrl.sft import fit_sft

    trainer, events = _recording_sft_trainer(tiny_model_dir)
    answers = iter([True, True, False])
    stats = fit_sft(trainer, _samples(n=4), epochs=2, batch_size=2, max_epochs=9,
                    keep_going=lambda passes: events.append(passes) or next(answers))
    assert stats["sft_passes"] == 4
    assert events == ["step"] * 4 + ["sync", 2] + ["step"] * 2 + ["sync", 3] + ["step"] * 2 + ["sync", 4, "sync"]
    events.clear()
    stats = fit_sft(trainer, _samples(n=4), epochs=1, batch_size=4, max_epochs=3,
                    keep_going=lambda passes: events.append(passes) or True)
    assert stats["sft_passes"] == 3 and [e for e in events if isinstance(e, float)] == [1, 2, 3]


def test_sft_selection_readings_every_fraction_of_a_pass(tiny_model_dir):
    """sft.select_every < 1: after pass `epochs`, keep_going is asked every that many passes (rounded to
    whole batches), with the generator synced first; a False stops mid-pass, and the capped end is read."""
    from agentrl.sft import fit_sft

    trainer, events = _recording_sft_trainer(tiny_model_dir)
    answers = iter([True, True, False])  # 4 batches a pass, a reading every 2
    stats = fit_sft(trainer, _samples(n=8), epochs=1, batch_size=2, max_epochs=3, check_every=0.5,
                    keep_going=lambda passes: events.append(passes) or next(answers))
    assert stats["sft_passes"] == 2.0
    assert events == ["step"] * 4 + ["sync", 1.0] + ["step"] * 2 + ["sync", 1.5] + ["step"] * 2 + ["sync", 2.0, "sync"]
    events.clear()
    stats = fit_sft(trainer, _samples(n=8), epochs=1, batch_size=2, max_epochs=2, check_every=0.75,
                    keep_going=lambda passes: events.append(passes) or True)
    assert stats["sft_passes"] == 2.0 and [e for e in events if isinstance(e, float)] == [1.0, 1.75, 2.0]


def test_sft_selection_stops_after_patience_passes_without_a_new_best():
    from agentrl.sft import still_rising

    assert still_rising([0.2]) and still_rising([0.2, 0.3])
    assert not still_rising([0.3, 0.3]) and not still_rising([0.3, 0.29])  # a tie is no new best
    assert still_rising([0.3, 0.29], patience=2) and not still_rising([0.3, 0.29, 0.3], patience=2)
    assert still_rising([0.3, 0.29, 0.31], patience=2)


def test_shared_prefix_len_counts_only_real_tokens():
    from agentrl.learner.engine import batch_prefix_len
    from agentrl.prefix import shared_prefix_len

    assert shared_prefix_len([[0, 0, 5, 6, 7], [0, 0, 5, 6, 9]], minimum=1) == 4
    assert shared_prefix_len([[0, 0, 5], [0, 0, 5]], minimum=1) == 2  # each row keeps a token
    assert shared_prefix_len([[0, 0, 5, 6, 7], [0, 0, 5, 6, 9]]) == 0  # under MIN_SHARED_PREFIX
    assert shared_prefix_len([[1] * 30]) == 0  # one row
    ids = torch.tensor([[3] * 20 + [7], [3] * 20 + [9]])
    assert batch_prefix_len(ids, torch.ones_like(ids)) == 20
    left = torch.ones_like(ids)
    left[1, :2] = 0
    assert batch_prefix_len(ids, left) == 0  # left padding
    right = torch.ones_like(ids)
    right[1, 17:] = 0
    assert batch_prefix_len(ids, right) == 16  # the shorter row keeps one real token of its own


def test_sft_batches_by_length_cover_every_sample_once_with_less_padding():
    import random

    from agentrl.learner.batch import turn_sample
    from agentrl.sft import sft_batches

    rng = random.Random(0)
    samples = [turn_sample([1] * rng.randint(50, 400), [2], [0.0], 1.0, {}) for _ in range(1000)]
    plain = sft_batches(samples, 32, random.Random(1))
    grouped = sft_batches(samples, 32, random.Random(1), by_length=True)
    assert sorted(i for b in grouped for i in b) == list(range(1000)) and len(grouped) == len(plain)

    def padded(batches):
        return sum(len(b) * max(len(samples[i].ids) for i in b) for b in batches)
    assert padded(grouped) < 0.7 * padded(plain)


def test_bf16_autocast_trains_close_to_fp32(tiny_model_dir):
    """model.autocast=bf16: the same first loss within bf16 rounding, and the updates still lower it."""
    from agentrl.learner.batch import collate

    b = collate(_samples(n=4, seed=3), pad_id=0)

    def nll(mb, out):
        return -(out["logp"] * mb.loss_mask).sum() / mb.loss_mask.sum(), {}

    losses = {}
    for mode in ("", "bf16"):
        eng = TorchEngine(tiny_model_dir, EngineConfig(optim=OptimConfig(lr=3e-3), autocast=mode))
        losses[mode] = [eng.step(b, nll)["loss"] for _ in range(4)]
    assert losses["bf16"][0] == pytest.approx(losses[""][0], rel=0.02)
    assert losses["bf16"][-1] < losses["bf16"][0] - 0.1


@pytest.mark.parametrize("lora", [False, True])
def test_the_reference_policy_stays_frozen_while_the_policy_moves_and_kl_enters_the_loss(tiny_model_dir, lora):
    cfg = EngineConfig(optim=OptimConfig(lr=1e-2, grad_clip=None),
                       lora=LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None)
    eng = TorchEngine(tiny_model_dir, cfg)
    b = collate(_samples(), pad_id=0)
    with pytest.raises(RuntimeError, match="set_reference"):
        eng.ref_logprobs(b)
    eng.set_reference(None if lora else tiny_model_dir)
    start = eng.logprobs(b)
    assert torch.allclose(eng.ref_logprobs(b), start, atol=1e-5)

    def with_kl(mb, out):
        return ppo_objective(out["logp"], mb.old_logprobs, mb.advantages, mb.loss_mask,
                             Objective.of(AlgoCfg(kl="k3", kl_coef=0.5)), mb.ref_logprobs)

    with pytest.raises(ValueError, match="no reference log-probs"):
        eng.step(b, with_kl)
    b.ref_logprobs = eng.ref_logprobs(b)
    for _ in range(3):
        stats = eng.step(b, with_kl)
    moved = eng.logprobs(b)
    assert (moved - start).abs().max() > 1e-3  # the policy moved ...
    assert torch.allclose(eng.ref_logprobs(b), start, atol=1e-5)  # ... the reference did not
    assert stats["kl"] > 0


def test_a_reset_optimizer_steps_as_a_fresh_one(tiny_model_dir, tmp_path):
    """After SFT-like steps, reset_optimizer_state: the next step moves the weights exactly as a fresh
    optimizer on the same weights does (Adam's moments and bias correction start over); without the reset
    it does not."""
    from agentrl.learner.optim_state import reset_optimizer_state

    cfg = EngineConfig(optim=OptimConfig(lr=1e-3, grad_clip=None))
    sft, rl = collate(_samples(n=4, seed=2), pad_id=0), collate(_samples(n=4, seed=3), pad_id=0)
    nll = lambda mb, out: (sft_loss(out["logp"], mb.loss_mask), {})  # noqa: E731
    eng = TorchEngine(tiny_model_dir, cfg)
    for _ in range(3):
        eng.step(sft, nll)
    eng.export_weights(tmp_path / "sft")
    kept = TorchEngine(tiny_model_dir, cfg)
    kept.model.load_state_dict(eng.model.state_dict())
    kept.optimizer.load_state_dict(copy.deepcopy(eng.optimizer.state_dict()))  # loading shares the tensors
    fresh = TorchEngine(tmp_path / "sft", cfg)
    reset_optimizer_state(eng)
    for e in (eng, fresh, kept):
        e.step(rl, nll)
    after = lambda e: torch.cat([p.detach().flatten() for p in e.model.parameters()])  # noqa: E731
    assert torch.allclose(after(eng), after(fresh), atol=1e-6)
    assert not torch.allclose(after(kept), after(fresh), atol=1e-6)


@pytest.mark.extended  # torch.compile on a CPU takes minutes; scripts/gpu_check.sh compiles on CUDA
@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
                    reason="torch.compile on CPU needs a C++ compiler")
def test_a_compiled_decoder_trains_as_the_eager_one(tiny_model_dir, tmp_path):
    """model.compile: the same losses and updated weights as eager steps (LoRA, rows sharing a system
    prompt, new lengths each step), and the weights keep their names for checkpoints and weight sync."""
    g = torch.Generator().manual_seed(5)
    system = torch.randint(4, 300, (20,), generator=g).tolist()

    def batch(k):
        return collate([turn_sample(system + s.ids, [7, 8, 9][:1 + (i + k) % 3], [-5.0] * (1 + (i + k) % 3), 1.0)
                        for i, s in enumerate(_samples(n=4 + k, seed=k))], pad_id=0)

    def nll(mb, out):
        return -(out["logp"] * mb.loss_mask).sum() / mb.loss_mask.sum(), {}

    from torch._dynamo.utils import counters

    counters.clear()
    runs = {}
    for compiled in (False, True):
        eng = TorchEngine(tiny_model_dir, EngineConfig(optim=OptimConfig(lr=3e-3), lora=LoraSettings(r=4, alpha=8),
                                                       compile=compiled))
        losses = [eng.step(batch(k), nll)["loss"] for k in range(3)]
        runs[compiled] = (losses, dict(eng.iter_weights()))
    assert counters["stats"]["unique_graphs"] > 0  # the decoder did run compiled
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-4)
    assert runs[True][1].keys() == runs[False][1].keys()
    assert all(torch.allclose(runs[True][1][k], runs[False][1][k], atol=1e-5) for k in runs[False][1])


def test_compile_under_deepspeed_is_refused_with_what_to_do(tiny_model_dir):
    from agentrl.learner.deepspeed_engine import DeepSpeedEngine

    with pytest.raises(NotImplementedError, match="trainer.engine=torch"):
        DeepSpeedEngine(tiny_model_dir, EngineConfig(compile=True))


def test_mask_logits_keeps_only_the_allowed_ids_by_hand():
    from agentrl.learner.logprobs import mask_logits

    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    out = torch.log_softmax(mask_logits(logits, torch.tensor([[0, 2, -1], [-1, -1, -1]])), -1)
    # row 0 drawn among ids 0 and 2: log(e^1 / (e^1 + e^3)); row 1 unconstrained
    assert float(out[0, 0]) == pytest.approx(1.0 - math.log(math.exp(1) + math.exp(3)), abs=1e-6)
    assert float(out[0, 1].exp()) == 0.0 and float(out[0, 3].exp()) == 0.0
    assert torch.allclose(out[1], torch.log_softmax(logits[1], -1))


@pytest.mark.parametrize("fast", [False, True])
def test_learner_logprobs_of_constrained_turns_equal_the_generators(tiny_generator, tiny_model_dir, fast):
    """A batch mixing constrained and free turns: the learner renormalizes over each constrained token's
    allowed ids (both forward paths) and so reads the generator's own log-probs; free turns are unchanged."""
    from agentrl.learner.engine import forward_batch

    g, tok = tiny_generator, tiny_generator.tokenizer
    prompts = [tok(f"Task {i}: move.", add_special_tokens=False)["input_ids"] for i in range(3)]
    choices = [tok(f"<answer>{a}</answer>", add_special_tokens=False)["input_ids"] for a in ("Up", "Down", "Left")]
    sampling = SamplingParams(temperature=0.7, max_new_tokens=12, seed=1, stop=["</answer>"])
    outs = g.generate(prompts, sampling, seeds=[1, 2, 3], choices=[choices, None, choices])
    samples = [turn_sample(p, o.ids, o.logprobs, 1.0, gen_allowed=o.allowed) for p, o in zip(prompts, outs)]
    eng = TorchEngine(tiny_model_dir)
    eng.model.load_state_dict(g.model.state_dict())
    b = collate(samples, pad_id=eng.pad_id)
    assert b.allowed is not None and b.allowed.shape[:2] == b.loss_mask.shape
    m = b.loss_mask.bool()
    with torch.no_grad():
        lp = forward_batch(eng.model, None, b, 0.7, targets_only=fast)["logp"]
    assert torch.allclose(lp[m], b.old_logprobs[m], atol=1e-4)
    assert torch.allclose(eng.logprobs(b, 0.7)[m], b.old_logprobs[m], atol=1e-4)
    sub = b.select([1, 2])  # micro-batching keeps each row's allowed ids
    assert torch.equal(sub.allowed[1][:sub.loss_mask.shape[1]], b.allowed[2][:sub.loss_mask.shape[1]])


def test_episode_sample_carries_each_turns_allowed_ids():
    t1 = Turn([1, 2], [5, 6], [-0.1, 0.0], "", [], True, "", 0.0, False, gen_allowed=[[5, 7], [6]])
    t2 = Turn([1, 2, 5, 6, 9], [8], [-0.2], "", [], True, "", 1.0, True, gen_allowed=[[8, 4]])
    ep = Episode("e", "t", 0)
    ep.turns = [t1, t2]
    s = episode_sample(ep, [1.0, 1.0])
    assert s.allowed == {2: [5, 7], 3: [6], 5: [8, 4]}
    b = collate([s], pad_id=0)
    assert b.allowed[0, 1].tolist() == [5, 7] and b.allowed[0, 2].tolist() == [6, -1]
    assert b.allowed[0, 4].tolist() == [8, 4] and (b.allowed[0, 0] == -1).all()


def test_bf16_autocast_is_used_only_where_bf16_is_native(capsys):
    """model.autocast=bf16 on a CPU without bf16 instructions (emulated: several times slower than fp32) trains
    in fp32 and says so in one line; CUDA and CPUs with AVX512-BF16, AMX or aarch64's BF16 keep it."""
    from agentrl.config_loader import load_config
    from agentrl.learner import engine as eng
    from agentrl.learner.models import native_bf16

    avx2 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
    assert not native_bf16("cpu", avx2)
    assert native_bf16("cpu", avx2.replace("avx2", "avx2 avx512f avx512_bf16"))
    assert native_bf16("cpu", "Features\t: fp asimd bf16 i8mm\n") and native_bf16("cuda:0", avx2)
    cfg = load_config("grpo", env="sokoban", overrides=["model.autocast=bf16"])
    want = "bf16" if native_bf16("cpu") else ""
    assert eng.EngineConfig.of(cfg, "cpu", False).autocast == want
    assert ("model.autocast=bf16 is not used" in capsys.readouterr().err) == (want == "")
    assert eng.EngineConfig.of(cfg, "cuda:0", False).autocast == "bf16"
