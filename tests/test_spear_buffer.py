"""SPEAR's replay buffer at the paper's batch (issue 84): D counts turn samples and is sized to the run's batch,
so self-imitation fires within the first steps (the paper: every two or three, appendix A.4), and the update
is J_GRPO + gamma * J_SIL, each term a mean over its own rows (eq. 5)."""
import random
from types import SimpleNamespace

from agentrl import load_config
from agentrl.types import Episode, Turn


def turn(won=False):
    return Turn([1, 2, 3], [5, 6], [-1.0, -1.0], "", ["Up"], True, "", 1.0 if won else 0.0, won, "stop")


def paper_batch(step, turns=16):
    """32 groups x 8 episodes (Table 8's ALFWorld batch) of 16 turns, two wins a group: ~4K turn samples."""
    return [Episode("sokoban", f"t-{step}-{g}", 0, group_id=f"{step}-{g}",
                    turns=[turn(won=i < 2 and k == turns - 1) for k in range(turns)], won=i < 2)
            for g in range(32) for i in range(8)]


def tokens_adv(rows):
    return sum(a for s in rows for a, m in zip(s.advantages, s.loss_mask) if m)


def n_tokens(rows):
    return sum(sum(s.loss_mask) for s in rows)


def test_self_imitation_fires_within_three_steps_at_the_papers_batch(tiny_model_dir, tmp_path):
    import json
    import shutil

    from agentrl.learner.engine import EngineConfig, OptimConfig, TorchEngine
    from agentrl.recipe import RECIPES
    import agentrl.recipes  # noqa: F401  (registers the recipe classes)

    # a model folder that is not a demo model (the tiny build's config names it the demo): the paper's settings
    real = tmp_path / "real"
    shutil.copytree(tiny_model_dir, real)
    conf = json.loads((real / "config.json").read_text())
    conf.pop("agentrl_model")
    (real / "config.json").write_text(json.dumps(conf))
    cfg = load_config("spear", env="sokoban", model=str(real),
                      overrides=["rollout.groups=32", "rollout.group_size=8", "extra.warmup_steps=2"])
    recipe = RECIPES.get(cfg.method)(cfg)
    assert recipe.sil.capacity == 2048  # the paper's N_D at the paper's batch
    # the tiny model re-scores the replay rows (their old log-probs under the current policy)
    engine = TorchEngine(tiny_model_dir, EngineConfig(optim=OptimConfig(lr=1e-5), token_budget=100_000))
    trainer = SimpleNamespace(engine=engine, rng=random.Random(0), step=0)
    fired = None
    for step in range(3):
        trainer.step, recipe.t = step, step + 1
        episodes = paper_batch(step)
        kept, _ = recipe.filter(episodes)
        samples, _ = recipe.make_batch(trainer, kept)
        before = [list(s.advantages) for s in samples]
        metrics = {}
        sil = recipe.extra_samples(trainer, kept, samples, metrics)
        if sil:
            fired = step
            break
        assert metrics["sil_buffer"] == 64 * 16 * (step + 1)  # the wins' turn samples, not 64 trajectories
    assert fired == 1, "D (2048 turn samples) fills at the second step: 64 wins x 16 turns a step"
    # eq. 5: the batch's one token mean equals mean(J_GRPO rows) + gamma * mean(J_SIL rows)
    gamma = recipe.gamma()
    assert 0 < gamma
    orig = sum(a for adv, s in zip(before, samples) for a, m in zip(adv, s.loss_mask) if m) / n_tokens(samples)
    # every imitated token's A~ = R_win - P50 = R_win - (2 R_win + 6 R_loss) / 8 = 0.75 x 2 (the tool bonus is
    # the same for both); one token mean over both kinds of row would weigh it by N_SIL / N instead
    both = (tokens_adv(samples) + tokens_adv(sil)) / (n_tokens(samples) + n_tokens(sil))
    assert abs(both - (orig + gamma * 1.5)) < 0.02, (both, orig, gamma)
    assert recipe.sil.size == 0 and metrics["sil_trajectories"] == 128  # both steps' 64 wins, all A~ > 0
    assert all(lp < 0 for s in sil for lp, m in zip(s.old_logprobs, s.loss_mask) if m)  # the model's, re-scored


def test_buffer_size_follows_the_runs_batch():
    from agentrl.recipes.spear import paper_buffer_size

    assert paper_buffer_size(256) == 2048 and paper_buffer_size(64) == 512 and paper_buffer_size(1) == 8
