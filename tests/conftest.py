"""Shared fixtures: a tiny model built from a small corpus (seconds), reused by the generation tests."""
import os

import pytest
from hypothesis import settings

# The fuzz tests draw the same examples every run, so CI fails on a change, not on the luck of a draw (a
# fresh draw once found a TextWorld hang by chance). HYPOTHESIS_PROFILE=explore draws new ones, for hunting.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

CORPUS = [
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets.",
    "<think>I should go Up now.</think><answer>Up || Left</answer>",
    "State:\n# # # # # #\n# _ X O _ #\n# P _ _ _ #\n# # # # # #",
    "Your admissible actions of the current situation are: ['go to countertop 1', 'look'].",
    "<think>the mug is here</think><action>take mug 1 from countertop 1</action>",
] * 20


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process, DeepSpeed, real-engine or end-to-end training tests "
                                       "(seconds to minutes each); `make test-fast` leaves them out")
    config.addinivalue_line("markers", "extended: minutes-long checks whose ground other tests of `make test` "
                                       "also cover; `make test-extended` (AGENTRL_TEST_EXTENDED=1) runs them")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("AGENTRL_TEST_EXTENDED") == "1":
        return
    skip = pytest.mark.skip(reason="extended: `make test-extended` runs it")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from agentrl.model_zoo import build_tiny

    out = tmp_path_factory.mktemp("tiny")
    build_tiny(out, corpus=CORPUS, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=2)
    return out


@pytest.fixture(scope="session")
def tiny_generator(tiny_model_dir):
    from agentrl.generation.embedded import EmbeddedGenerator

    return EmbeddedGenerator.from_folder(tiny_model_dir)


@pytest.fixture(scope="session")
def sokoban_sft_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model after a short SFT on Sokoban demos (~15 s): it writes valid actions most of the
    time, so rollouts have reward variance and RL steps have gradients (an untrained model's groups are
    all alike and every update is skipped)."""
    from agentrl import Trainer
    from agentrl.config_loader import load_config

    out = tmp_path_factory.mktemp("sft-run")
    cfg = load_config("grpo", env="sokoban", overrides=[
        f"model.name={tiny_model_dir}", f"trainer.out_dir={out}", "trainer.steps=0", "trainer.progress=false",
        "trainer.tensorboard=false", "sft.demos=48", "sft.epochs=3", "sft.lr=3e-3", "sft.batch_size=8",
        "sft.max_epochs=0", "sft.target_success=0", "eval.tasks=0",
        "rollout.max_turns=3"])
    t = Trainer.from_config(cfg)
    try:
        t.train()
    finally:
        t.close()
    return out / "warm_start"
