"""Opt-in integration test against a real vLLM server (`make test-vllm`; needs `make vllm-setup`)."""
import os

import pytest

from agentrl.generation.vllm import VLLMServer, vllm_command, vllm_python

pytestmark = pytest.mark.skipif(os.environ.get("AGENTRL_TEST_VLLM") != "1",
                                reason="opt-in: run `make test-vllm` (starts a real vLLM server, ~90 s)")


@pytest.mark.timeout(900)
def test_vllm_serves_rollouts(tiny_generator, tiny_model_dir, tmp_path):
    from agentrl.rollout.engine import RolloutConfig, RolloutEngine, Start
    from agentrl.types import SamplingParams
    from envs.pool import InProcessEnvs

    assert vllm_python() is not None
    server = VLLMServer(tiny_model_dir, port=18631, log_file=str(tmp_path / "vllm.log"))
    client = server.start()
    try:
        cfg = RolloutConfig(max_turns=2, sampling=SamplingParams(temperature=1.0, max_new_tokens=16, seed=0))
        ep = RolloutEngine(client, tiny_generator.tokenizer, InProcessEnvs("sokoban", 2), "sokoban", cfg).run(
            [Start("train/00000"), Start("train/00001")])[0]
        turn = ep.turns[0]
        assert turn.gen_ids and len(turn.gen_ids) == len(turn.gen_logprobs)
        from agentrl.learner.logprobs import completion_logprobs

        ref = completion_logprobs(tiny_generator.model, turn.prompt_ids, turn.gen_ids)
        assert max(abs(a - b) for a, b in zip(ref, turn.gen_logprobs)) < 0.1  # vLLM runs bf16 on CPU
    finally:
        server.stop()


def test_command_shape(tiny_model_dir):
    cmd = vllm_command(tiny_model_dir, 9000, cpu=True)
    assert "--enforce-eager" in cmd and "bfloat16" in cmd and "127.0.0.1" in cmd
