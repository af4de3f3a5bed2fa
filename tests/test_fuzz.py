"""Arbitrary text, as a sampled model can write it, never crashes or hangs the parser or an env's step
(property-based: hypothesis draws the text, control characters and lone surrogates included)."""
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.envs import make
from agentrl.rollout.parsing import parse_turn

TEXT = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=200) | st.sampled_from(
    ["\x00", "go\x00north", "\ud800", "<action>\x00</action>", "<action>" * 50, "search[\x07]", "click[\u202e]"])


@settings(max_examples=300, deadline=None)
@given(TEXT, st.sampled_from(["action", "answer"]), st.integers(1, 5))
def test_the_parser_takes_any_text(text, tag, budget):
    def clean(a):  # non-empty, no control character, no lone surrogate
        return a and not any(unicodedata.category(c) in ("Cc", "Cs") for c in a)

    assert all(clean(a) for a in parse_turn(text, tag, budget, require_think=False).actions)
    assert all(clean(a) for a in parse_turn(f"<{tag}>{text}</{tag}>", tag, budget).actions)


ENGINE = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.parametrize("name", ["sokoban", "frozenlake", "bandit", "webshop",
                                  *(pytest.param(n, marks=ENGINE) for n in ("textworld", "alfworld", "scienceworld"))])
def test_every_env_steps_through_any_text(name):
    env = make(name)
    task = env.tasks("train")[0].task_id

    @settings(max_examples=30 if name in ("textworld", "alfworld", "scienceworld") else 150, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(TEXT)
    def step_any(text):
        env.reset(task, 0)
        obs, reward, terminated, truncated, info = env.step(text)
        assert isinstance(obs, str) and isinstance(reward, float) and "fingerprint" in info

    try:
        step_any()
    finally:
        env.close()
