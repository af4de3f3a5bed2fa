"""The agent programs in examples/ (the calculator agent with the plain openai client, with LangGraph, with the
OpenAI Agents SDK), trained as they are: each solves its tasks with a competent scripted policy, and trains GRPO
steps with the tiny model.
Each is skipped where its library is not installed (`pip install -e .[test]` installs them)."""
import json
import math

import pytest

from agentrl.envs.pool import InProcessEnvs
from agentrl.rollout.engine import RolloutConfig, RolloutEngine, Start
from agentrl.types import SamplingParams
from tests.agent_programs import competent_calculator
from tests.test_agent_program import Scripted
from tests.test_staleness import run

EXAMPLES = {"openai_client": ("examples.calc_agent:run_agent", ("openai",)),  # the guide's, for comparison
            "langgraph": ("examples.langgraph_agent:run_agent", ("langgraph", "langchain_openai")),
            "agents_sdk": ("examples.agents_sdk_agent:run_agent", ("agents",))}


def _needs(name):
    program, modules = EXAMPLES[name]
    for m in modules:
        pytest.importorskip(m)
    return program


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_library_example_solves_its_tasks_with_a_competent_policy(name, tiny_model_dir):
    from agentrl.learner.models import load_tokenizer

    program = _needs(name)
    tok = load_tokenizer(tiny_model_dir)
    gen = Scripted(tok, competent_calculator)
    gen.tokenizer = tok
    envs = InProcessEnvs(f"agent:{program}", 2, {"tasks": "examples/calc_tasks.jsonl", "timeout_s": 120})
    engine = RolloutEngine(gen, tok, envs, f"agent:{program}", RolloutConfig(
        max_turns=4, sampling=SamplingParams(max_new_tokens=200)))
    try:
        eps = engine.run([Start(f"valid/0000{i}", 0, f"g{i}") for i in range(3)])
    finally:
        envs.close()
    assert [(e.error, e.won, e.score, len(e.turns)) for e in eps] == [("", True, 1.0, 2)] * 3
    assert all(json.loads(e.turns[0].actions[0])["name"] == "calculator" for e in eps)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_library_example_trains_two_grpo_steps(name, tiny_model_dir, tmp_path):
    """The example as it is, its reward its own: the random-weight tiny model never answers right, so every
    group has one reward (no advantage): the zero-variance filter is off and an entropy term on, so each step
    still updates the weights on the turns the program's requests recorded."""
    from agentrl.config_loader import load_config

    program = _needs(name)
    cfg = load_config("grpo", env=f"agent:{program}", overrides=[
        f"model.name={tiny_model_dir}", f"trainer.out_dir={tmp_path}", "trainer.steps=2", "trainer.tensorboard=false",
        "trainer.progress=false", "rollout.groups=2", "rollout.group_size=4", "rollout.slots=4", "rollout.max_turns=4",
        "rollout.max_new_tokens=48", "eval.tasks=2", "eval.every=2", "env_kwargs.tasks=examples/calc_tasks.jsonl",
        "env_kwargs.timeout_s=120", "algo.filters=[dropped]", "algo.entropy_coef=0.01"])
    run(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:  # the random-weight policy's episodes end, well or badly, but never as the program's failure
        assert r["agent_failures"] == 0.0 and r["turns_per_episode"] >= 1.0 and math.isfinite(r["loss"])
        assert not r.get("skipped_update")


def test_the_calculator_agent_asks_calc_tools_first_prompts_token_for_token(tiny_model_dir):
    """examples/calc_agent.py on examples/calc_agent_tasks.py: the same problems under the same ids as calc-tools,
    and the same first prompt, so calc-tools' SFT warm start serves the program (examples/calc_agent_smollm2.yaml;
    in other words the warm start answered none of 60, docs/guides/tools.md)."""
    from agentrl.envs import make
    from agentrl.envs.calc_tools import problem
    from agentrl.learner.models import load_tokenizer
    from agentrl.rollout.agent_program import chat_renderer
    from agentrl.rollout.tool_prompts import tool_prompt_ids
    from examples.calc_agent import CALCULATOR, SYSTEM, question
    from examples.calc_agent_tasks import tasks

    tok = load_tokenizer(tiny_model_dir)
    env = make("calc-tools")
    spec = env.prompt_spec()
    program = {s: [t for t in tasks() if t["split"] == s] for s in ("train", "valid")}
    for split, i in [("train", 0), ("train", 1999), ("valid", 0), ("valid", 1), ("valid", 59)]:
        task = program[split][i]
        assert (task["expression"], task["answer"], task["category"]) == problem(split, i)
        obs, _ = env.reset(f"{split}/{i:05d}", 0)
        ours = chat_renderer(tok, "hermes")([{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": question(task)}], [CALCULATOR])
        assert ours == tool_prompt_ids(tok, spec, spec.instruction, obs, [])


def test_the_calculator_agent_scores_a_final_reply_as_calc_tools_does():
    """The program's reward is calc-tools' rule for the same reply, so it trains calc-tools' warm start toward
    what calc-tools trained it toward: its old rule (the text between the last <answer> and the first </answer>)
    rewarded <answer>27</answer></answer>, which calc-tools fails (its warm start's second likeliest token after
    '</answer' is '></')."""
    from agentrl.envs import make
    from agentrl.envs.tools import decode_action
    from agentrl.rollout.tool_prompts import parse_tool_turn
    from examples.calc_agent import solved

    env = make("calc-tools")
    env.reset("valid/00000", 0)
    n = env.value
    replies = [f"<answer>{n}</answer>", f"<answer>{n}</answer></answer>", f"<answer>{n}</answer</answer>",
               f"<answer>{n}</answer>\n<answer>{n}</answer>", f"<answer>{n + 1}</answer><answer>{n}</answer>",
               f"<answer>{n}</answer><answer>{n + 1}</answer>", f"<answer> {n}. </answer>", f"<answer>{n}",
               f"{n}", f"The answer is <answer>{n}</answer> done", f"<answer>{n}.5</answer>", "<answer></answer>"]
    theirs = []
    for text in replies:
        parsed, calls = parse_tool_turn(text, env.prompt_spec(), 4)
        assert calls == 0
        theirs.append(env.score_answer(decode_action(parsed.actions[0]).text)[1])
    assert [solved(text, n) for text in replies] == theirs
    assert theirs[:3] == [True, False, False]
