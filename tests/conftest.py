"""Shared fixtures: a tiny model built from a small corpus (seconds), reused by the generation tests."""
import pytest

CORPUS = [
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets.",
    "<think>I should go Up now.</think><answer>Up || Left</answer>",
    "State:\n# # # # # #\n# _ X O _ #\n# P _ _ _ #\n# # # # # #",
    "Your admissible actions of the current situation are: ['go to countertop 1', 'look'].",
    "<think>the mug is here</think><action>take mug 1 from countertop 1</action>",
] * 20


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from agentrl.learner.models import build_tiny

    out = tmp_path_factory.mktemp("tiny")
    build_tiny(out, corpus=CORPUS, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=2)
    return out


@pytest.fixture(scope="session")
def tiny_generator(tiny_model_dir):
    from agentrl.generation.embedded import EmbeddedGenerator

    return EmbeddedGenerator.from_folder(tiny_model_dir)
