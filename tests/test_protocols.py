"""Every backend implements the written protocol of its seam (signatures checked, not just names)."""
import inspect

import pytest


def _same_signatures(protocol, cls):
    for name, member in vars(protocol).items():
        if name.startswith("_") or not callable(member):
            continue
        want = list(inspect.signature(member).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got[:len(want)] == want, (cls.__name__, name, got, want)


def test_generators_implement_the_generator_protocol():
    from agentrl.generation.base import Generator
    from agentrl.generation.client import RemoteGenerator
    from agentrl.generation.embedded import EmbeddedGenerator
    from agentrl.generation.vllm_fleet import VLLMFleet

    for cls in (EmbeddedGenerator, RemoteGenerator, VLLMFleet):
        _same_signatures(Generator, cls)
        assert hasattr(cls, "stages")
        if cls is not RemoteGenerator:  # those that can stage have the two calls staging takes
            assert callable(cls.stage) and callable(cls.load_weights)
    from agentrl.generation.base import TakesWeightsMidCollect

    for cls in (EmbeddedGenerator, VLLMFleet):  # in-flight updates (trainer.inflight_updates)
        _same_signatures(TakesWeightsMidCollect, cls)


def test_env_slots_implement_the_slots_protocol():
    from agentrl.envs.pool import EnvPool, InProcessEnvs
    from agentrl.envs.slots import EnvSlots

    for cls in (EnvPool, InProcessEnvs):
        _same_signatures(EnvSlots, cls)
    slots = InProcessEnvs("bandit", 2)
    try:
        assert isinstance(slots, EnvSlots) and len(slots) == 2
        out = slots.reset({1: (slots.call(0, "tasks", "train")[0].task_id, 3)})
        assert list(out) == [1] and out[1].obs and not out[1].done
    finally:
        slots.close()


def test_every_registered_env_is_a_text_env_that_fills_in_the_contract():
    from agentrl.envs import registry
    from agentrl.envs.base import TextEnv

    must = ("tasks", "prompt_spec", "_reset", "_step")
    for name in registry.names():
        try:
            cls = registry.spec(name).load_class()
        except ImportError as e:  # an optional engine that is not installed
            pytest.skip(f"{name}: {e}")
        assert issubclass(cls, TextEnv), name
        for m in must:
            assert getattr(cls, m) is not getattr(TextEnv, m), f"{name} does not implement {m}"


def test_an_embedded_generator_on_the_learners_own_module_needs_no_sync(tiny_model_dir, tmp_path):
    from agentrl.generation.embedded import EmbeddedGenerator
    from agentrl.learner.engine import EngineConfig, TorchEngine
    from agentrl.learner.models import stop_token_ids
    from agentrl.learner.protocol import LearnerEngine

    engine = TorchEngine(tiny_model_dir, EngineConfig())
    assert isinstance(engine, LearnerEngine)
    shared = EmbeddedGenerator(engine.model, engine.tokenizer, stop_token_ids(engine.tokenizer, engine.model.config))
    assert shared.receive(engine, tmp_path) == {}
    copy = EmbeddedGenerator.from_folder(tiny_model_dir)
    with __import__("torch").no_grad():
        next(engine.model.parameters()).add_(1.0)
    copy.receive(engine, tmp_path)
    assert all((a == b).all() for a, b in zip(copy.model.state_dict().values(), engine.model.state_dict().values()))
