"""SPEAR's over-long samples (appendix A.8, issue 73): a response cut at the token limit leaves the loss,
but its episode keeps its place in its group, so the group's other rollouts keep their advantage."""
from agentrl import load_config
from agentrl.types import Episode, Turn


def turn(gen, finish="stop", won=False, prompt=(1, 2, 3)):
    return Turn(list(prompt), gen, [-1.0] * len(gen), "", ["Up"], True, "", 1.0 if won else 0.0, won, finish)


def episode(group, turns, won):
    return Episode("sokoban", f"t-{group}", 0, group_id=group, turns=turns, won=won)


def test_spear_masks_the_over_long_turn_and_keeps_its_episode_in_the_group():
    from agentrl.recipe import RECIPES
    import agentrl.recipes  # noqa: F401  (registers the recipe classes)

    cfg = load_config("spear_dr_bot", env="sokoban", overrides=["algo.filters=[dropped, overlong]"])
    recipe = RECIPES.get(cfg.method)(cfg)
    # group g: a win whose second turn was cut at the token limit, and a loss
    won = episode("g", [turn([5, 6]), turn([7, 8, 9], finish="length", won=True)], True)
    lost = episode("g", [turn([5])], False)
    samples, stats = recipe.make_batch(None, [won, lost])
    assert stats["masked_overlong"] == 1 and stats.get("filtered_overlong") is None
    assert [(s.meta["episode"], s.meta["turn"]) for s in samples] == [(0, 0), (1, 0)]  # the cut turn is out
    # the win still counts in the group's baseline: both kept samples carry a group-relative advantage
    adv = [next(a for a, m in zip(s.advantages, s.loss_mask) if m) for s in samples]
    assert adv[0] > 0 > adv[1]


def test_at_trajectory_level_the_over_long_episode_is_the_masked_sample():
    from agentrl.recipe import RECIPES
    import agentrl.recipes  # noqa: F401

    cfg = load_config("spear_dr_bot", env="sokoban", overrides=[
        "algo.filters=[dropped, overlong]", "algo.level=trajectory", "rollout.chat_mode=full"])
    recipe = RECIPES.get(cfg.method)(cfg)
    # one growing chat: the second turn's prompt holds the first turn's prompt and answer
    won = episode("g", [turn([5, 6]), turn([7, 8, 9], finish="length", won=True, prompt=(1, 2, 3, 5, 6, 4))], True)
    lost = episode("g", [turn([5])], False)
    samples, stats = recipe.make_batch(None, [won, lost])
    assert stats["masked_overlong"] == 1 and [s.meta["episode"] for s in samples] == [1]
    assert next(a for a, m in zip(samples[0].advantages, samples[0].loss_mask) if m) < 0
