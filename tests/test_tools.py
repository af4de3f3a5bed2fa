"""Tool envs (issue 86, first part): the calculator's safe evaluator, the Hermes tool-call parser on recorded
and hostile outputs, prompts that extend token for token with tool results masked, restore, and a tool env
trained end to end on the tiny model."""
import json
import re
import time

import pytest

from agentrl.envs import make
from agentrl.envs.calculator import CalcError, evaluate
from agentrl.envs.check import check_env
from agentrl.envs.tools import answer_action, call_action, decode_action, error_action
from agentrl.rollout.tool_formats import tool_parser
from agentrl.rollout.tool_parsers import BadCall, ParsedCalls, ToolCall, ToolParser
from agentrl.rollout.tool_prompts import (action_text, followup_ids, parse_tool_turn, template_support,
                                          tool_prompt_ids)
from agentrl.types import Completion

HERMES = tool_parser("hermes")

# A chat template with tool support in the shape of Qwen2.5's: tools listed in the system block, consecutive
# tool messages in one user block of <tool_response>s.
QWEN_LIKE = (  # every text in {{ }}: transformers renders templates with trim_blocks
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n<tools>' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- elif m.role != 'system' or not loop.first %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{% endif %}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


# ----- the calculator ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("expr,value", [("2 + 3 * 4", 14), ("(1 + 2) ** 3", 27), ("7 / 2", 3.5), ("7 // 2", 3),
                                        ("-7 % 3", 2), ("2 ** -2", 0.25), ("(" * 100 + "5" + ")" * 100, 5),
                                        ("1_000 - 1", 999)])
def test_calculator_computes_arithmetic(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr", [
    "__import__('os').system('echo hi')", "open('/etc/passwd').read()", "(1).__class__", "x + 1", "lambda: 1",
    "[i for i in range(10**9)]", "'a' * 10**9", "True + 1", "1 if 1 else 2", "2 ^ 3", "1 << 100000", "3 < 4",
    "9 ** 9 ** 9", "10 ** 10 ** 10", "2 ** 100000", "10 ** 155", "(10 ** 150) * (10 ** 150)", "1.5e308 * 10",
    "2.0 ** 5000", "(-8) ** 0.5", "1 / 0", "5 % 0", "(" * 200 + "1" + ")" * 200, "-" * 299 + "1", "1" * 400, "",
    "1 +", "1j * 2", "{1: 2}", "f'{1}'", "(1, 2)", "a.b", "exec('1')", "1; 2",
])
def test_calculator_refuses_unsafe_or_unbounded_input_fast(expr):
    t = time.perf_counter()
    with pytest.raises(CalcError):
        evaluate(expr)
    assert time.perf_counter() - t < 0.2


def test_calculator_refuses_non_text():
    with pytest.raises(CalcError, match="text"):
        evaluate(12)


# ----- the parser on recorded outputs ---------------------------------------------------------------------------
CALC = '{"name": "calculator", "arguments": {"expression": "2+3"}}'
RECORDED = [  # (model output, the calls read, or BadCall's error pattern)
    (f"<tool_call>\n{CALC}\n</tool_call>", [ToolCall("calculator", {"expression": "2+3"})]),
    (f"<think>two sums</think>\n<tool_call>{CALC}</tool_call>\n<tool_call>\n"
     '{"name": "calculator", "arguments": {"expression": "4*5"}}\n</tool_call>',
     [ToolCall("calculator", {"expression": "2+3"}), ToolCall("calculator", {"expression": "4*5"})]),
    # OpenAI-style arguments as a JSON string; an unclosed last call cut at the token budget
    ('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>',
     [ToolCall("calculator", {"expression": "1+1"})]),
    (f"<tool_call>\n{CALC}", [ToolCall("calculator", {"expression": "2+3"})]),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}</tool_call>', ["not valid JSON"]),
    ("<tool_call>calculator(2+3)</tool_call>", ["not valid JSON"]),
    ('<tool_call>{"arguments": {}}</tool_call>', ["JSON object"]),
    ('<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>', ["must be a JSON object"]),
    ('<tool_call>{"name": "calculator", "arguments": {}, "id": 3}</tool_call>', ["unexpected key"]),
    ('<tool_call>{"name": "calculator", "arguments": "{oops"}</tool_call>', ["arguments string"]),
    ("<tool_call></tool_call>", ["not valid JSON"]),
    ("The answer is <answer>5</answer>", []),
    ("5", []),
]


@pytest.mark.parametrize("text,expected", RECORDED)
def test_hermes_parser_reads_recorded_outputs(text, expected):
    got = HERMES.parse(text, 4).calls
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        if isinstance(e, str):
            assert isinstance(g, BadCall) and e in g.error
        else:
            assert g == e


def test_rendered_calls_parse_back():
    calls = [ToolCall("calculator", {"expression": "(3 + 4) * 2"}), ToolCall("search", {"q": "é || x", "k": [1, 2]})]
    assert HERMES.parse(HERMES.render(calls), 4).calls == calls


NESTED = '<tool_call>{"name": "c", "arguments": {"a": '
HOSTILE = {
    "1 MB of text": "x" * (1 << 20),
    "1 MB inside one call": "<tool_call>" + '{"name": "calculator", "arguments": {"expression": "' + "1+" * (1 << 19),
    "200k opening tags": "<tool_call>" * 200_000,
    "100k closed calls": f"<tool_call>{CALC}</tool_call>" * 100_000,
    "nested JSON 100k deep": NESTED + "[" * 100_000 + "]" * 100_000 + "}}</tool_call>",
    "nested JSON within the size limit": NESTED + "[" * 2000 + "]" * 2000 + "}}</tool_call>",
    "deep objects": '<tool_call>{"name": "c", "arguments": ' + '{"a": ' * 1000 + "1" + "}" * 1000 + "}</tool_call>",
    "surrogates and NULs": '<tool_call>{"name": "calc\\ud800", "arguments": {"e": "\\u0000"}}</tool_call>\x00\udcff',
    "1 MB answer": "<answer>" + "9" * (1 << 20) + "</answer>",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_outputs_parse_in_bounded_time_into_bounded_actions(name):
    from agentrl.envs.tools import ToolPromptSpec

    spec = ToolPromptSpec(system="s", instruction="i", tools=[])
    t = time.perf_counter()
    parsed, calls = parse_tool_turn(HOSTILE[name], spec, max_calls=4)
    assert time.perf_counter() - t < 1.0, name
    assert calls <= 4 and 1 <= len(parsed.actions) <= 4
    assert all(len(a) < 20_000 for a in parsed.actions)  # what reaches the env (and its trace) stays small
    if name == "100k closed calls":
        assert parsed.over_budget and calls == 4 and parsed.format_ok
    if "nested" in name or "deep" in name:
        assert not parsed.format_ok and ("nested" in parsed.error or "characters" in parsed.error)


def test_unknown_tools_and_wrong_argument_types_are_error_observations():
    env = make("calc-tools", max_steps=8)
    env.reset("train/00000")
    cases = [call_action("search", {"q": "x"}), call_action("calculator", {"expression": 5}),
             call_action("calculator", {}), call_action("calculator", {"expression": "2", "x": 1}),
             call_action("calculator", {"expression": "__import__('os')"}), error_action("bad JSON", "{oops"),
             "not json at all", json.dumps([1, 2])]
    for a in cases:
        obs, reward, terminated, _, info = env.step(a)
        assert obs.startswith("Error: ") and not terminated and reward == 0.0
        assert info["action_is_valid"] is False and info["tool_error"] is True
    assert env.done  # the step limit ended it, no exception on the way


def test_a_result_that_echoes_a_lone_surrogate_still_tokenizes(tiny_model_dir):
    from agentrl.envs.tools import Tool, ToolEnv
    from agentrl.learner.models import load_tokenizer

    class Echo(ToolEnv):
        name = "echo"

        def tools(self):
            return [Tool("echo", "echo", {"type": "object", "properties": {"s": {"type": "string"}}}, lambda s: s)]

        def tasks(self, split):
            from agentrl.envs.base import Task
            return [Task(f"{split}/00000", split)]

        def question(self, task, seed):
            return "say something"

    env = Echo()
    env.reset("train/00000")
    parsed, _ = parse_tool_turn('<tool_call>{"name": "echo", "arguments": {"s": "a\\ud800b"}}</tool_call>',
                                env.prompt_spec(), 4)
    obs, *_ = env.step(parsed.actions[0])
    assert obs.startswith("a") and obs.endswith("b")
    assert followup_ids(load_tokenizer(tiny_model_dir), env.prompt_spec(), [obs], True)


def test_a_user_parser_by_import_path():
    p = tool_parser("tests.test_tools:BracketParser")
    assert p.parse("[[calculator: 2+2]]", 4).calls == [ToolCall("calculator", {"expression": "2+2"})]
    with pytest.raises(KeyError, match="unknown tool parser 'nope'.*hermes"):
        tool_parser("nope")


class BracketParser(ToolParser):
    """A toy format of one's own: ``[[tool: expression]]``."""

    def parse(self, text, max_calls):
        found = re.findall(r"\[\[(\w+): ([^\]]*)\]\]", text[:10_000])
        return ParsedCalls([ToolCall(n, {"expression": e}) for n, e in found[:max_calls]], len(found) > max_calls)

    def render(self, calls):
        return "".join(f"[[{c.name}: {c.arguments.get('expression', '')}]]" for c in calls)

    def system_text(self, tools):
        return "Call a tool as [[name: expression]]."

    def results_text(self, results):
        return "\n".join(results)


# ----- prompts and turns ---------------------------------------------------------------------------------------
@pytest.fixture(params=["chatml", "qwen_like"])
def tok(request, tiny_model_dir):
    from agentrl.learner.models import load_tokenizer

    t = load_tokenizer(tiny_model_dir)
    if request.param == "qwen_like":
        t.chat_template = QWEN_LIKE
    return t


def test_templates_with_and_without_tool_support(tok):
    env = make("calc-tools")
    obs, _ = env.reset("train/00003")
    spec = env.prompt_spec()
    text = tok.decode(tool_prompt_ids(tok, spec, env.instruction(), obs, []))
    tools, role = template_support(tok)
    assert role  # both render the tool role
    assert '"name": "calculator"' in text and obs in text and spec.system in text
    # the template's own tool block, or the parser's fallback text in the system message
    assert ("# Tools\n<tools>" in text) == tools and ("<tool_call></tool_call> tags" in text) == (not tools)
    follow = tok.decode(followup_ids(tok, spec, ["14", "Error: bad"], ended_by_eos=True))
    if tools:
        assert follow == "\n<|im_start|>user\n<tool_response>\n14\n</tool_response>\n<tool_response>\nError: bad\n" \
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    else:
        assert follow == "\n<|im_start|>tool\n14<|im_end|>\n<|im_start|>tool\nError: bad<|im_end|>\n" \
                         "<|im_start|>assistant\n"


def test_sft_targets_are_the_parser_format_and_parse_back_to_the_expert_actions():
    from agentrl.sft import answer_text

    env = make("calc-tools")
    env.reset("train/00005")
    spec = env.prompt_spec()
    call = env.expert_action()
    text = answer_text(spec, call)
    assert text.startswith("<tool_call>\n{") and text.endswith("}\n</tool_call>")
    assert parse_tool_turn(text, spec, 4)[0].actions == [call]
    env.step(call)
    answer = env.expert_action()
    assert answer_text(spec, answer) == f"<answer>{decode_action(answer).text}</answer>"
    assert parse_tool_turn(answer_text(spec, answer), spec, 4)[0].actions == [answer]
    assert action_text(spec, answer_action("7")) == "<answer>7</answer>"


def test_sft_prompts_are_the_rollouts_prompts_token_for_token_on_the_expert_path(tok):
    """SFT renders each step's prompt from the history; the rollout extends the last prompt with the sampled ids
    and the results. On the expert's path the two are the same ids, so the warm start trains on the prompts
    the policy will see."""
    from agentrl.rollout.engine import RolloutConfig
    from agentrl.sft import demo_steps, noisy_expert_episode

    env = make("calc-tools")
    for task in env.tasks("train")[:12]:
        trace, observations, infos, labels = noisy_expert_episode(env, task.task_id, 0)
        steps = demo_steps(tok, RolloutConfig(), (trace, observations, infos, labels, env.prompt_spec(),
                                                  env.instruction()))
        assert len(steps) == 2
        (p0, target0, _), (p1, _, _) = steps
        assert p1 == p0 + target0 + followup_ids(tok, env.prompt_spec(), [observations[1]], ended_by_eos=True)


class ScriptedGenerator:
    """Answers each prompt with a recorded turn, chosen by how many assistant turns the prompt holds, tokenized
    by the real tokenizer (a unit-test double: the token bookkeeping is what is tested, not the model)."""

    SCRIPT = [
        "<think>use the tool</think><tool_call>\n"
        "{{\"name\": \"calculator\", \"arguments\": {{\"expression\": \"{e}\"}}}}"
        "\n</tool_call>\n<tool_call>{{\"name\": \"calculator\", \"arguments\": {{\"expression\": </tool_call>",
        "<tool_call>{{\"name\": \"abacus\", \"arguments\": {{}}}}</tool_call>",
        "<answer>{v}</answer>",
    ]

    def __init__(self, tok):
        self.tok = tok

    def generate(self, prompts, sampling, seeds=None, **kw):
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            expr = re.search(r"Expression: ([^\n<]*)", text).group(1).strip()
            turn = text.count("<|im_start|>assistant") - 1
            reply = self.SCRIPT[turn].format(e=expr, v=evaluate(expr))
            ids = self.tok(reply, add_special_tokens=False)["input_ids"]
            if turn < 2:  # a call turn ends with end-of-text; the answer stops at </answer>
                ids = ids + [self.tok.eos_token_id]
            out.append(Completion(ids, [-0.5] * len(ids), reply, "stop"))
        return out


@pytest.mark.parametrize("chat_mode", ["window", "full"])
def test_each_prompt_extends_the_last_and_only_sampled_ids_are_targets(tok, chat_mode):
    from agentrl.envs.pool import InProcessEnvs
    from agentrl.learner.batch import episode_sample
    from agentrl.metrics import episode_diagnostics
    from agentrl.rollout.engine import RolloutConfig, RolloutEngine, Start
    from agentrl.types import SamplingParams

    envs = InProcessEnvs("calc-tools", 2)
    cfg = RolloutConfig(max_turns=5, chat_mode=chat_mode, sampling=SamplingParams(max_new_tokens=200))
    eps = RolloutEngine(ScriptedGenerator(tok), tok, envs, "calc-tools", cfg).run(
        [Start("train/00001", 0, "g"), Start("test/00002", 3, "g")])
    envs.close()
    for ep in eps:
        assert len(ep.turns) == 3 and ep.won and ep.turns[-1].done
        t0, t1, t2 = ep.turns
        assert t0.info["tool_calls"] == 2 and t0.info["tool_errors"] == 1 and not t0.format_ok  # one malformed
        assert t1.info["tool_calls"] == 1 and t1.info["tool_errors"] == 1 and t1.format_ok  # unknown tool
        expr = decode_action(t0.actions[0]).arguments["expression"]
        assert t2.format_ok and t2.actions == [answer_action(str(evaluate(expr)))]
        for a, b in zip(ep.turns, ep.turns[1:]):  # no re-tokenization: the next prompt starts with this one
            assert b.prompt_ids[:len(a.prompt_ids) + len(a.gen_ids)] == a.prompt_ids + a.gen_ids
            between = tok.decode(b.prompt_ids[len(a.prompt_ids) + len(a.gen_ids):])
            assert all(r in between for r in a.info["tool_results"]) and "<|im_start|>assistant" in between
        assert "Error: unknown tool 'abacus'" in t1.info["tool_results"][0]
        s = episode_sample(ep, [1.0] * 3)
        targets = [i for i, m in zip(s.ids, s.loss_mask) if m]
        assert targets == t0.gen_ids + t1.gen_ids + t2.gen_ids  # results and template tokens are context
    d = episode_diagnostics(eps, lambda e: float(e.won))
    assert d["tool_calls"] == 6 and d["tool_errors"] == 4 and d["valid_format"] == pytest.approx(2 / 3)


def test_tool_episodes_are_alike_async_in_worker_processes_and_from_a_restored_start(tok):
    """The same scripted turns give the same episodes token for token in lockstep (in-process envs) and async
    (env worker processes); a start restored after one recorded call picks up with that call and its result
    in its first prompt."""
    from dataclasses import replace

    from agentrl.envs.pool import EnvPool, InProcessEnvs
    from agentrl.envs.replay import record
    from agentrl.rollout.engine import RolloutConfig, RolloutEngine, Start
    from agentrl.types import SamplingParams

    env = make("calc-tools")
    env.reset("train/00004")
    call = env.expert_action()
    trace, observations = record(make("calc-tools"), "train/00004", 0, [call])
    starts = [Start("train/00001", 0, "g"), Start("valid/00002", 1, "g"),
              Start("train/00004", 0, "r", trace=trace, t0=1)]
    cfg = RolloutConfig(max_turns=5, sampling=SamplingParams(max_new_tokens=200))
    with InProcessEnvs("calc-tools", 2) as envs:
        lock = RolloutEngine(ScriptedGenerator(tok), tok, envs, "calc-tools", cfg).run(starts)
    with EnvPool("calc-tools", 2) as envs:
        asy = RolloutEngine(ScriptedGenerator(tok), tok, envs, "calc-tools", replace(cfg, mode="async")).run(starts)

    def sig(eps):
        return [(e.task_id, e.start_index, e.won, [(t.prompt_ids, t.gen_ids, t.actions, t.fingerprints, t.reward)
                                                  for t in e.turns]) for e in eps]

    assert sig(asy) == sig(lock)
    restored = lock[2]
    assert restored.start_index == 1 and restored.prefix_actions == [call] and len(restored.turns) == 2
    assert restored.won and restored.turns[0].info["tool_results"][0].startswith("Error: unknown tool")
    first = tok.decode(restored.turns[0].prompt_ids)
    assert action_text(env.prompt_spec(), call) in first and observations[1] in first


def test_restore_by_replay_and_snapshot_and_the_restored_prompt():
    from agentrl.envs.pool import InProcessEnvs
    from agentrl.envs.replay import record

    rep = check_env("calc-tools", n_expert=12, n_replay=12)
    assert rep.ok and rep.success_rate == 1.0 and rep.snapshot_checked == 12, rep.summary()
    env = make("calc-tools")
    env.reset("train/00002")
    first = env.expert_action()
    trace, observations = record(env, "train/00002", 0, [error_action("bad"), first])
    envs = InProcessEnvs("calc-tools", 1)
    try:
        r = envs.restore({0: (trace, 2, None)})[0]
        assert r.obs == observations[2] and r.info["fingerprint"] == trace.fingerprints[2]
    finally:
        envs.close()


def test_restored_history_renders_as_calls_and_tool_messages(tok):
    env = make("calc-tools")
    obs0, _ = env.reset("train/00002")
    call = env.expert_action()
    obs1, *_ = env.step(call)
    spec = env.prompt_spec()
    text = tok.decode(tool_prompt_ids(tok, spec, env.instruction(), obs1, [(obs0, call)]))
    assert text.count(obs0) == 1 and action_text(spec, call) in text and f"\n{obs1}" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_the_guides_tool_env_example_passes_the_env_self_check(tmp_path, monkeypatch):
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[1] / "docs/guides/tools.md").read_text()
    code = guide[guide.index("# mypkg/lookup.py"):]
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "lookup.py").write_text(code[:code.index("```")])
    monkeypatch.syspath_prepend(str(tmp_path))
    rep = check_env("mypkg.lookup:CapitalsEnv", n_expert=3, n_replay=3)
    assert rep.ok and rep.success_rate == 1.0 and rep.snapshot_checked == 3, rep.summary()


# ----- end to end ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_calc_tools_trains_two_grpo_steps_on_the_tiny_model(tiny_model_dir, tmp_path):
    from agentrl import Trainer
    from agentrl.config_loader import load_config

    cfg = load_config("grpo", env="calc-tools", overrides=[
        f"model.name={tiny_model_dir}", f"trainer.out_dir={tmp_path}", "trainer.steps=2", "trainer.tensorboard=false",
        "trainer.progress=false", "rollout.groups=2", "rollout.group_size=2", "rollout.slots=4",
        "rollout.max_turns=3", "rollout.max_new_tokens=96", "eval.tasks=4", "eval.every=2", "sft.demos=48",
        "sft.enabled=true", "sft.epochs=8", "sft.lr=3e-3", "sft.batch_size=16", "sft.max_epochs=0",
        "sft.target_success=0", "rollout.format_penalty=-0.1"])
    t = Trainer.from_config(cfg)
    try:
        t.train()
    finally:
        t.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:  # every rollout step counts its calls, its refused calls and its format failures
        assert {"tool_calls", "tool_errors", "valid_format"} <= set(r) and 0.0 <= r["valid_format"] <= 1.0
    assert rows[0]["expert_success"] == 1.0
    # after SFT the model writes calls (mostly malformed at this size): the multi-turn tool path ran
    assert sum(r.get("tool_calls", 0) + r.get("eval/tool_calls", 0) for r in rows) > 0
