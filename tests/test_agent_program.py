"""Any agent program (`--env agent:pkg.mod:fn`): the capture endpoint in front of the generator, the episodes
it records (token for token what the generator returned), failures that stay the episode's, and GRPO
trained through it. Real HTTP servers, the real `openai` client, the real tiny model."""
import json
import os
import threading
import time

import httpx
import openai
import pytest

from agentrl.envs.base import EnvError
from agentrl.envs.pool import InProcessEnvs
from agentrl.envs.registry import make, spec
from agentrl.generation.capture import CaptureServer, CaptureService
from agentrl.learner.models import load_tokenizer
from agentrl.metrics import episode_diagnostics
from agentrl.rollout import agent_program
from agentrl.rollout.agent_program import chat_renderer, reply_parser
from agentrl.rollout.engine import RolloutConfig, RolloutEngine, Start
from agentrl.types import Completion, SamplingParams, turns_nest

TASKS = "tests.agent_programs:tasks"


class Recording:
    """The real generator, with every row it returned kept (prompt, ids, log-probs)."""

    def __init__(self, gen):
        self.gen, self.rows, self.stop_ids = gen, [], getattr(gen, "stop_ids", ())
        self.model, self.tokenizer = gen.model, gen.tokenizer  # its context, as the rollout reads it

    def generate(self, prompts, sampling, seeds=None, choices=None):
        outs = self.gen.generate(prompts, sampling, seeds=seeds)
        self.rows += [(tuple(p), tuple(c.ids), tuple(c.logprobs)) for p, c in zip(prompts, outs)]
        return outs

    def __getattr__(self, name):
        return getattr(self.gen, name)


class Scripted:
    """A test double: answers each prompt with the text ``reply(prompt text)`` returns, as token ids."""

    def __init__(self, tok, reply):
        self.tok, self.reply, self.stop_ids, self.prompts = tok, reply, (), []

    def generate(self, prompts, sampling, seeds=None, choices=None):
        out = []
        for p in prompts:
            self.prompts.append(list(p))
            text = self.reply(self.tok.decode(p))
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            out.append(Completion(ids, [-0.25] * len(ids), text, "stop"))
        return out


def _rollout(gen, program, starts, max_turns=4, **env_kwargs):
    envs = InProcessEnvs(f"agent:{program}", 2, {"tasks": TASKS, **env_kwargs})
    cfg = RolloutConfig(max_turns=max_turns, sampling=SamplingParams(temperature=1.0, max_new_tokens=24, seed=3))
    engine = RolloutEngine(gen, gen.tokenizer if hasattr(gen, "tokenizer") else gen.tok, envs, f"agent:{program}", cfg)
    return engine.run(starts), engine.stats


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def capture(tok):
    """A capture endpoint whose policy calls the calculator once, then answers."""
    def reply(prompt):
        if "<|im_start|>tool" in prompt:  # the tiny model's template has a tool role
            return "<answer>5</answer>"
        return 'Let me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'

    gen = Scripted(tok, reply)
    service = CaptureService(gen, tok, SamplingParams(max_new_tokens=400), chat_renderer(tok, "hermes"),
                             reply_parser("hermes"), context=4096)
    server = CaptureServer(service)
    yield server, service, gen
    server.close()


CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}}}}}


# ----- the endpoint ----------------------------------------------------------------------------------------
def test_the_openai_client_gets_tool_calls_and_each_request_is_recorded_under_its_episode(capture, tok):
    server, service, gen = capture
    eid = service.open(stream=1, max_requests=4)
    other = service.open(stream=2, max_requests=4)
    client = openai.OpenAI(base_url=server.base_url(eid), api_key=server.api_key, max_retries=0)
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    first = client.chat.completions.create(model="anything", messages=msgs, tools=[CALC])
    m = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and m.content == "Let me compute."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == \
        [("calculator", {"expression": "2+3"})]
    # the assistant message goes back as the client gives it (content and tool_calls), then the tool's result
    msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "5"}]
    second = client.chat.completions.create(model="anything", messages=msgs, tools=[CALC])
    assert second.choices[0].message.content == "<answer>5</answer>" and not second.choices[0].message.tool_calls
    assert [c.id for c in client.models.list().data] == ["policy"]

    calls = service.end(eid)
    assert service.end(other) == []  # the other episode recorded nothing of this one's
    assert len(calls) == 2 and gen.prompts == [c.prompt_ids for c in calls]
    # the tiny model's template knows no tools: they are described in the system message and the call is
    # shown as the parser writes it; the result is a tool message
    first_prompt, second_prompt = (tok.decode(c.prompt_ids) for c in calls)
    assert '"name": "calculator"' in first_prompt and "<tool_call>" in second_prompt
    assert "<|im_start|>tool\n5<|im_end|>" in second_prompt
    assert calls[0].reply.calls == [("calculator", {"expression": "2+3"})] and calls[1].reply.calls == []
    # the records hold the generator's ids and log-probs as it returned them
    assert all(c.ids == c.completion.ids and c.logprobs == c.completion.logprobs for c in calls)
    # the episode has ended: its requests are refused and not recorded
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="anything", messages=msgs)


def test_max_tokens_and_stop_cut_the_sampled_ids_exactly(capture, tok):
    server, service, gen = capture
    eid = service.open(stream=1, max_requests=4)
    client = openai.OpenAI(base_url=server.base_url(eid), api_key=server.api_key, max_retries=0)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], max_tokens=3)
    s = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], stop=["compute"])
    short, stopped = service.end(eid)
    assert r.choices[0].finish_reason == "length" and short.ids == short.completion.ids[:3]
    assert short.logprobs == short.completion.logprobs[:3]
    assert s.choices[0].message.content == "Let me " and s.choices[0].finish_reason == "stop"
    assert "compute" in tok.decode(stopped.ids) and "compute" not in tok.decode(stopped.ids[:-1])
    assert stopped.ids == stopped.completion.ids[:len(stopped.ids)] and len(stopped.ids) < len(stopped.completion.ids)


def test_a_max_tokens_over_the_runs_cap_is_served_at_the_cap_with_one_warning(capture, caplog, monkeypatch):
    """examples/calc_agent.py asked 96 tokens of a run capped at 48: its calls were cut without a word."""
    from agentrl.generation import capture as capture_mod

    server, service, gen = capture
    monkeypatch.setattr(capture_mod, "_warned_caps", set())
    monkeypatch.setattr(service.sampling, "max_new_tokens", 5)
    eid = service.open(stream=1, max_requests=4)
    client = openai.OpenAI(base_url=server.base_url(eid), api_key=server.api_key, max_retries=0)
    with caplog.at_level("WARNING", logger="agentrl.generation.capture"):
        for _ in range(2):  # the same ask again: no second line
            r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], max_tokens=9)
            assert r.choices[0].finish_reason == "length"
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], max_tokens=5)
    assert [len(c.ids) for c in service.end(eid)] == [5, 5, 5]
    warned = [r.getMessage() for r in caplog.records if "max_tokens" in r.getMessage()]
    assert warned == ["an agent program asked max_tokens=9, above rollout.max_new_tokens=5: its replies are cut at 5 "
                      "(set rollout.max_new_tokens=9 to give it what it asks)"]


def test_malformed_requests_get_a_4xx_naming_the_fault_and_harm_no_other_request(capture):
    server, service, gen = capture
    eid = service.open(stream=1, max_requests=64)
    url = f"{server.base_url(eid)}/chat/completions"
    auth = {"Authorization": f"Bearer {server.api_key}"}
    good = {"model": "m", "messages": [{"role": "user", "content": "What is 2+3?"}], "tools": [CALC]}
    bad = [
        (b"{not json", 400, None),
        (json.dumps({**good, "stream_options": {"include_usage": True}}), 400, "stream_options"),  # no stream
        (json.dumps({**good, "n": 2}), 400, "n"),
        (json.dumps({**good, "messages": []}), 400, "messages"),
        (json.dumps({**good, "messages": [{"role": "wizard", "content": "x"}]}), 400, "messages"),
        (json.dumps({**good, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400, "messages"),
        (json.dumps({**good, "messages": [{"role": "assistant", "tool_calls": [{"function": 3}]}]}), 400, "messages"),
        (json.dumps({**good, "tools": [{"type": "function", "function": {"description": "no name"}}]}), 400, "tools"),
        (json.dumps({**good, "temperature": "hot"}), 400, "temperature"),
        (json.dumps({**good, "messages": [{"role": "user", "content": "x" * 100_000}]}), 400, "messages"),
        (b"x" * (9 << 20), 413, None),
    ]
    results: dict[int, tuple[int, dict]] = {}

    def send(k, body, headers=auth, to=url):
        r = httpx.post(to, content=body if isinstance(body, bytes) else body.encode(), headers=headers, timeout=60)
        results[k] = (r.status_code, r.json() if r.headers.get("content-type", "").startswith("application/json")
                      else {})

    threads = [threading.Thread(target=send, args=(k, body)) for k, (body, _, _) in enumerate(bad)]
    threads += [threading.Thread(target=send, args=(100 + k, json.dumps(good))) for k in range(4)]
    threads += [threading.Thread(target=send, args=(200, json.dumps(good), {})),  # no key
                threading.Thread(target=send, args=(201, json.dumps(good), auth,
                                                    url.replace(eid, "0" * 32)))]  # no such episode
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, (_, status, param) in enumerate(bad):
        assert results[k][0] == status, (k, results[k])
        assert results[k][1]["error"]["message"] and results[k][1]["error"]["param"] == param
    assert [results[100 + k][0] for k in range(4)] == [200] * 4
    assert results[200][0] == 401 and results[201][0] == 404
    assert len(service.end(eid)) == 4  # the good requests, and nothing of the bad ones
    assert httpx.get(f"{server.root}/health").status_code == 200


def _client(server, eid):
    return openai.OpenAI(base_url=server.base_url(eid), api_key=server.api_key, max_retries=0)


def test_streaming_and_non_streaming_give_the_same_tokens_and_records(capture):
    """A streamed reply is the whole generation, recorded, then sent as chunks: its content, tool calls,
    token ids (our ``token_ids`` per chunk), log-probs and usage are the non-streamed reply's, and both
    episodes record the same turn."""
    server, service, gen = capture
    plain_eid, stream_eid = service.open(stream=1, max_requests=4), service.open(stream=1, max_requests=4)
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    whole = _client(server, plain_eid).chat.completions.create(model="m", messages=msgs, tools=[CALC], logprobs=True)
    chunks = list(_client(server, stream_eid).chat.completions.create(
        model="m", messages=msgs, tools=[CALC], logprobs=True, stream=True, stream_options={"include_usage": True}))
    body = [c for c in chunks if c.choices]
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert body[0].choices[0].delta.role == "assistant" and len(body) > 4  # content token by token
    content = "".join(c.choices[0].delta.content or "" for c in body)
    calls = [t for c in body for t in c.choices[0].delta.tool_calls or []]
    ids = [t for c in body for t in c.choices[0].token_ids]
    lps = [lp.logprob for c in body if c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    w = whole.choices[0]
    assert content == w.message.content == "Let me compute."
    assert [(t.index, t.id[:5], t.function.name, t.function.arguments) for t in calls] == \
        [(0, "call_", "calculator", w.message.tool_calls[0].function.arguments)]
    assert body[-1].choices[0].finish_reason == w.finish_reason == "tool_calls"
    assert ids == w.token_ids and lps == [lp.logprob for lp in w.logprobs.content]
    assert chunks[-1].usage == whole.usage and not chunks[-1].choices  # usage in a final chunk of its own
    (plain,), (streamed,) = service.end(plain_eid), service.end(stream_eid)
    assert streamed.ids == plain.ids == ids and streamed.logprobs == plain.logprobs == lps
    assert streamed.prompt_ids == plain.prompt_ids and streamed.reply == plain.reply
    # without include_usage no chunk carries usage; the reply ends with data: [DONE]
    eid = service.open(stream=1, max_requests=4)
    raw = httpx.post(f"{server.base_url(eid)}/chat/completions", json={"messages": msgs, "stream": True},
                     headers={"Authorization": f"Bearer {server.api_key}"}, timeout=30)
    assert raw.headers["content-type"].startswith("text/event-stream") and raw.text.endswith("data: [DONE]\n\n")
    assert '"usage"' not in raw.text and len(service.end(eid)) == 1


def test_the_real_model_streamed_sends_the_tokens_it_recorded(tiny_generator):
    """The tiny model's sampled text (odd tokens, split characters): a streamed request and a plain one of the
    same sampling stream draw the same tokens, and the chunks' token ids and text are exactly them."""
    tok = tiny_generator.tokenizer
    service = CaptureService(tiny_generator, tok, SamplingParams(temperature=1.0, max_new_tokens=24, seed=5),
                             chat_renderer(tok, "hermes"), reply_parser("hermes"), context=512)
    server = CaptureServer(service)
    try:
        msgs = [{"role": "user", "content": "What is 2+3?"}]
        plain_eid, stream_eid = service.open(stream=7, max_requests=2), service.open(stream=7, max_requests=2)
        whole = _client(server, plain_eid).chat.completions.create(model="m", messages=msgs, logprobs=True)
        chunks = [c for c in _client(server, stream_eid).chat.completions.create(
            model="m", messages=msgs, logprobs=True, stream=True) if c.choices]
        (plain,), (streamed,) = service.end(plain_eid), service.end(stream_eid)
        assert streamed.ids == plain.ids and streamed.logprobs == plain.logprobs and len(plain.ids) > 4
        assert [t for c in chunks for t in c.choices[0].token_ids] == plain.ids == whole.choices[0].token_ids
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
        assert len(chunks) > len(plain.ids) // 2  # token by token (a split character waits for the next)
        assert [lp.logprob for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.content] == \
            plain.logprobs
    finally:
        server.close()


def test_tool_choice_none_and_auto_are_honoured_and_forcing_needs_a_parser_that_opens_calls(capture):
    server, service, gen = capture
    eid = service.open(stream=1, max_requests=8)
    client = _client(server, eid)
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    auto = client.chat.completions.create(model="m", messages=msgs, tools=[CALC], tool_choice="auto")
    none = client.chat.completions.create(model="m", messages=msgs, tools=[CALC], tool_choice="none")
    assert auto.choices[0].message.tool_calls and auto.choices[0].finish_reason == "tool_calls"
    # none: no call is read; the whole text is the content (the tools are still in the prompt)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
    assert none.choices[0].message.content.startswith("Let me compute.<tool_call>")
    # this endpoint was given no call openings (call_prefix): forcing a call is refused, naming the field
    for choice in ["required", {"type": "function", "function": {"name": "calculator"}}]:
        with pytest.raises(openai.BadRequestError, match="is not served") as e:
            client.chat.completions.create(model="m", messages=msgs, tools=[CALC], tool_choice=choice)
        assert e.value.body["param"] == "tool_choice"
    recorded = service.end(eid)
    assert [len(c.reply.calls) for c in recorded] == [1, 0]  # the refused requests recorded nothing
    assert recorded[0].ids == recorded[1].ids  # the same tokens, read two ways


WORD = {"type": "function", "function": {"name": "word", "parameters": {"type": "object", "properties": {}}}}


def test_a_forced_tool_choice_constrains_the_call_s_opening_and_the_learner_sees_the_constraint(tiny_generator):
    """tool_choice named/required on the real tiny model: the completion opens with a call of the named tool
    (or one of the request's tools), drawn by the constrained decoding the envs use; those tokens record the
    ids they were drawn among, which the episode's turn hands the learner (``gen_allowed``)."""
    from agentrl.rollout.agent_program import call_prefix, to_episode

    tok = tiny_generator.tokenizer
    service = CaptureService(tiny_generator, tok, SamplingParams(temperature=1.0, max_new_tokens=56, seed=5),
                             chat_renderer(tok, "hermes"), reply_parser("hermes"), context=1024,
                             call_prefix=call_prefix("hermes"))
    server = CaptureServer(service)
    try:
        eid = service.open(stream=3, max_requests=4)
        client = _client(server, eid)
        msgs = [{"role": "user", "content": "q"}]
        client.chat.completions.create(model="m", messages=msgs, tools=[CALC, WORD],
                                       tool_choice={"type": "function", "function": {"name": "calculator"}})
        client.chat.completions.create(model="m", messages=msgs, tools=[CALC, WORD], tool_choice="required")
        client.responses.create(model="m", input="q", tools=[RESPONSES_CALC],
                                tool_choice={"type": "function", "name": "calculator"})
        with pytest.raises(openai.BadRequestError, match="leaves none of the reply's 8"):  # the opening: 45 tokens
            client.chat.completions.create(model="m", messages=msgs, tools=[CALC], tool_choice="required", max_tokens=8)
        with pytest.raises(openai.BadRequestError, match="not among the request's tools"):
            client.chat.completions.create(model="m", messages=msgs, tools=[WORD],
                                           tool_choice={"type": "function", "function": {"name": "calculator"}})
        named, required, responses = service.end(eid)
    finally:
        server.close()
    opening = {n: tok(call_prefix("hermes")(n), add_special_tokens=False)["input_ids"] for n in ("calculator", "word")}
    assert tok.decode(opening["calculator"]).endswith('{"name": "calculator", "arguments": {')
    for rec in (named, responses):
        k = len(opening["calculator"])
        assert rec.ids[:k] == opening["calculator"] and rec.completion.allowed == [[t] for t in rec.ids[:k]]
        assert len(rec.ids) > k and rec.logprobs[:k] == [0.0] * k  # one id allowed: drawn with certainty
    drawn = next(o for o in opening.values() if required.ids[:len(o)] == o)
    assert len(required.completion.allowed) == len(drawn)  # among the two openings, then free
    assert any(len(a) == 2 for a in required.completion.allowed)  # where the two tools' openings part
    start = Start("train/00000", 0, "g0")
    turn = to_episode("agent:x", start, {}, [named], 0.0, False, "", 4).turns[0]
    assert turn.gen_allowed == named.completion.allowed and turn.gen_ids == named.ids


def test_a_forced_call_is_returned_as_a_tool_call(tok):
    """The forced opening and the policy's continuation read as one call (a scripted policy that completes
    the opening it is given)."""
    from agentrl.rollout.agent_program import call_prefix

    class Completing(Scripted):
        def generate(self, prompts, sampling, seeds=None, choices=None):
            out = []
            for k in range(len(prompts)):
                forced = choices[k] if choices else None
                ids = forced[0] if forced else self.tok('"expression": "2+3"}}\n</tool_call>',
                                                      add_special_tokens=False)["input_ids"]
                out.append(Completion(ids, [0.0] * len(ids), self.tok.decode(ids), "stop",
                                      [[t] for t in ids] if forced else []))
            return out

    service = CaptureService(Completing(tok, None), tok, SamplingParams(max_new_tokens=400),
                             chat_renderer(tok, "hermes"), reply_parser("hermes"), context=4096,
                             call_prefix=call_prefix("hermes"))
    server = CaptureServer(service)
    try:
        eid = service.open(stream=1, max_requests=4)
        r = _client(server, eid).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "q"}], tools=[CALC], tool_choice="required")
        (call,) = r.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "2+3"})
        (rec,) = service.end(eid)
        assert rec.reply.calls == [("calculator", {"expression": "2+3"})]
    finally:
        server.close()


def test_parallel_tool_calls_false_reads_the_first_call_only(tok):
    two = "".join(f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{e}"}}}}\n</tool_call>'
                  for e in ("1+1", "2+2"))
    service = CaptureService(Scripted(tok, lambda p: two), tok, SamplingParams(max_new_tokens=400),
                             chat_renderer(tok, "hermes"), reply_parser("hermes"), context=4096)
    server = CaptureServer(service)
    try:
        eid = service.open(stream=1, max_requests=4)
        client = _client(server, eid)
        msgs = [{"role": "user", "content": "q"}]
        both = client.chat.completions.create(model="m", messages=msgs, tools=[CALC])
        one = client.chat.completions.create(model="m", messages=msgs, tools=[CALC], parallel_tool_calls=False)
        assert len(both.choices[0].message.tool_calls) == 2
        assert [json.loads(c.function.arguments) for c in one.choices[0].message.tool_calls] == [{"expression": "1+1"}]
        a, b = service.end(eid)
        # the dropped call is recorded as malformed: counted in tool_errors, the turn not well formed
        assert len(a.reply.calls) == 2 and not a.reply.malformed
        assert b.reply.calls == [("calculator", {"expression": "1+1"})] and len(b.reply.malformed) == 1
    finally:
        server.close()


def test_an_unhonoured_field_is_a_400_naming_it_and_the_others_are_taken(capture):
    server, service, gen = capture
    eid = service.open(stream=1, max_requests=16)
    client = _client(server, eid)
    msgs = [{"role": "user", "content": "q"}]
    refused = [({"response_format": {"type": "json_object"}}, "response_format"),
               ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
                "response_format"),
               ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"logit_bias": {"5": 10}}, "logit_bias"),
               ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"), ({"modalities": ["audio"]}, "modalities"),
               ({"extra_body": {"reasoning_effort": "high"}}, "reasoning_effort"),
               ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
               ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
               ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options")]
    for kwargs, param in refused:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=msgs, **kwargs)
        assert e.value.body["param"] == param and param in e.value.body["message"], (kwargs, e.value.body)
    # taken: max_completion_tokens as max_tokens, fields that describe the caller, OpenAI defaults, text format
    short = client.chat.completions.with_raw_response.create(
        model="m", messages=msgs, max_completion_tokens=3, user="u", metadata={"k": "v"}, store=False,
        frequency_penalty=0, response_format={"type": "text"}, temperature=0.2, top_p=None)  # null: not given
    assert short.parse().choices[0].finish_reason == "length" and len(short.parse().choices[0].token_ids) == 3
    assert short.headers["agentrl-overridden"] == "temperature"  # the run's sampling, said in the reply
    (rec,) = service.end(eid)
    assert rec.ids == rec.completion.ids[:3]
    # Anthropic's messages API is not served: a 404 that says so (at the path its client would use too)
    eid = service.open(stream=1, max_requests=4)
    r = httpx.post(f"{server.base_url(eid)}/v1/messages", json={"model": "m", "messages": msgs, "max_tokens": 8},
                   headers={"Authorization": f"Bearer {server.api_key}"}, timeout=30)
    assert r.status_code == 404 and "messages API" in r.json()["error"]["message"]
    assert service.end(eid) == []


RESPONSES_CALC = {"type": "function", "name": "calculator", "description": "Evaluate arithmetic.",
                  "parameters": CALC["function"]["parameters"]}


def test_the_responses_api_multi_turn_with_tools_by_previous_response_id_or_full_input(capture):
    """The Responses API: a function call out, its output back, either by ``previous_response_id`` (kept per
    episode) or by the full ``input`` list: both render the same prompt; streamed events carry the same
    response. Every request is one recorded turn, as on the chat route."""
    server, service, gen = capture
    eid = service.open(stream=1, max_requests=8)
    client = _client(server, eid)
    ask = dict(model="m", instructions="You compute.", tools=[RESPONSES_CALC])
    first = client.responses.create(input="What is 2+3?", **ask)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("calculator", {"expression": "2+3"})
    assert first.output[0].content[0].text == "Let me compute." and first.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
    chained = client.responses.create(previous_response_id=first.id, input=[result], **ask)
    full = client.responses.create(input=[{"role": "user", "content": "What is 2+3?"}]
                                   + [o.model_dump(exclude_none=True) for o in first.output] + [result], **ask)
    assert chained.output_text == full.output_text == "<answer>5</answer>"
    with client.responses.stream(previous_response_id=first.id, input=[result], **ask) as events:
        kinds = [e.type for e in events]
        streamed = events.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and streamed.output_text == chained.output_text
    assert streamed.usage.input_tokens == chained.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as e:  # an id of no response of this episode
        client.responses.create(previous_response_id="resp_unknown", input=[result], **ask)
    assert e.value.body["param"] == "previous_response_id"
    for kwargs, param in [({"input": [{"type": "reasoning", "summary": []}]}, "input"),
                          ({"input": "q", "tools": [{"type": "web_search"}]}, "tools"),
                          ({"input": "q", "text": {"format": {"type": "json_object"}}}, "text"),
                          ({"input": "q", "tool_choice": "required"}, "tool_choice"),
                          ({"input": "q", "extra_body": {"background": True}}, "background")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="m", **kwargs)
        assert e.value.body["param"] == param, (kwargs, e.value.body)
    recorded = service.end(eid)
    assert len(recorded) == 4 and recorded[1].prompt_ids == recorded[2].prompt_ids == recorded[3].prompt_ids
    assert recorded[0].reply.calls == [("calculator", {"expression": "2+3"})]


def test_an_openai_agents_sdk_program_runs_on_either_model_class_whole_or_streamed(capture):
    """The OpenAI Agents SDK as written: its chat-completions and Responses model classes, with Runner.run and
    Runner.run_streamed, call the tool and finish; each run is two recorded turns, the same tokens."""
    agents = pytest.importorskip("agents")
    import asyncio

    server, service, gen = capture
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate arithmetic."""
        return "5"

    async def run(model_class, streamed):
        eid = service.open(stream=1, max_requests=4)
        client = openai.AsyncOpenAI(base_url=server.base_url(eid), api_key=server.api_key, max_retries=0)
        agent = agents.Agent(name="calc", instructions="You compute.", tools=[calculator],
                             model=model_class(model="policy", openai_client=client))
        if streamed:
            result = agents.Runner.run_streamed(agent, "What is 2+3?")
            async for _ in result.stream_events():
                pass
        else:
            result = await agents.Runner.run(agent, "What is 2+3?")
        return result.final_output, [(c.ids, [n for n, _ in c.reply.calls]) for c in service.end(eid)]

    for model_class in (agents.OpenAIChatCompletionsModel, agents.OpenAIResponsesModel):
        whole, streamed = (asyncio.run(run(model_class, s)) for s in (False, True))
        assert whole == streamed and whole[0] == "<answer>5</answer>", model_class
        assert [names for _, names in whole[1]] == [["calculator"], []]


def test_an_episode_s_requests_stop_at_its_budget(capture):
    server, service, gen = capture
    eid = service.open(stream=1, max_requests=2)
    client = openai.OpenAI(base_url=server.base_url(eid), api_key=server.api_key, max_retries=0)
    for _ in range(2):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    with pytest.raises(openai.RateLimitError, match="made its 2 requests"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    assert len(service.end(eid)) == 2


def test_calls_in_the_history_are_rendered_by_the_template_or_in_the_parsers_format(tiny_model_dir):
    """A template with tools (Qwen-like) lists them itself; whichever template, an assistant message's
    tool_calls stay in the history (in the parser's format where the template writes content only)."""
    from agentrl.generation.requests import ToolChatBody, template_messages
    from tests.test_tools import QWEN_LIKE

    body = ToolChatBody.model_validate({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+3?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "calculator", "arguments": '{"expression": "2+3"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}], "tools": [CALC]})
    msgs = template_messages(body)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"expression": "2+3"}  # an object, as templates want
    for template in (None, QWEN_LIKE):
        t = load_tokenizer(tiny_model_dir)
        if template:
            t.chat_template = template
        text = t.decode(chat_renderer(t, "hermes")(msgs, body.tools))
        assert "What is 2+3?" in text
        assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>' in text
        assert ("# Tools\n<tools>" in text) == bool(template)  # the template's own tool list, or the parser's text
        assert ("<tool_call></tool_call> tags" in text) == (not template)
        assert "<tool_response>\n5\n</tool_response>" in text or "<|im_start|>tool\n5<|im_end|>" in text


# ----- the env spec ------------------------------------------------------------------------------------------
def test_the_agent_env_spec_and_its_task_sources(tmp_path):
    s = spec("agent:tests.agent_programs:chatty")
    assert s.entry == "agentrl.envs.agent_program:AgentProgramEnv"
    assert s.kwargs == {"program": "tests.agent_programs:chatty"}
    env = make("agent:tests.agent_programs:chatty", tasks=TASKS)
    assert [t.task_id for t in env.tasks("train")][:2] == ["train/00000", "train/00001"]
    assert len(env.tasks("train")) == 6 and len(env.tasks("valid")) == 2 and env.tasks("test") == []
    assert env.task_payload("valid/00001") == {"question": "Push box 7.", "split": "valid"}
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"q": 1}\n\n{"q": 2, "split": "test", "category": "hard"}\n')
    env = make("agent:tests.agent_programs:chatty", tasks=str(path))
    assert env.tasks("test")[0].category == "hard" and env.task_payload("train/00000") == {"q": 1}
    with pytest.raises(EnvError, match="step"):
        env.reset("train/00000")
        env.step("anything")
    path.write_text('{"q": 1}\n[1, 2\n')
    with pytest.raises(EnvError, match="line 2 is not JSON"):
        make("agent:tests.agent_programs:chatty", tasks=str(path))
    path.write_text('{"split": "holdout"}\n')
    with pytest.raises(EnvError, match="split 'holdout'"):
        make("agent:tests.agent_programs:chatty", tasks=str(path))
    with pytest.raises(EnvError, match="env_kwargs.tasks is required"):
        make("agent:tests.agent_programs:chatty")
    with pytest.raises(EnvError, match="unknown option"):
        make("agent:tests.agent_programs:chatty", tasks=TASKS, bogus=1)


# ----- episodes -------------------------------------------------------------------------------------------------
def test_episodes_are_token_exact_with_what_the_generator_returned(tiny_generator):
    gen = Recording(tiny_generator)
    starts = [Start(f"train/0000{i}", i, f"g{i // 2}") for i in range(4)]
    eps, stats = _rollout(gen, "tests.agent_programs:chatty", starts)
    assert [e.task_id for e in eps] == [s.task_id for s in starts] and not any(e.error for e in eps)
    rows = {(p, ids): lp for p, ids, lp in gen.rows}
    for e in eps:
        assert len(e.turns) == 2  # each request is a turn
        first, second = e.turns
        assert len(first.gen_ids) <= 12  # the request's max_tokens cut the sampled ids
        for t in e.turns:
            full = next(ids for p, ids in rows if p == tuple(t.prompt_ids) and ids[:len(t.gen_ids)] == tuple(t.gen_ids))
            assert tuple(t.gen_logprobs) == rows[(tuple(t.prompt_ids), full)][:len(t.gen_ids)]
        # the second prompt holds the first reply (as the template renders it back) and the new message
        assert len(second.prompt_ids) > len(first.prompt_ids)
        assert second.reward == e.score and second.done and first.reward == 0.0 and not first.done
    assert stats["turns"] == 8 and stats["generated_tokens"] == sum(len(t.gen_ids) for e in eps for t in e.turns)


def test_through_agentrl_serve_the_episodes_are_the_embedded_generators(tiny_generator):
    """The endpoint goes through the Generator interface: a served generator (``agentrl serve``, batching
    the episodes' concurrent requests itself) samples the same tokens, each request with its episode's seed."""
    from agentrl.generation.client import RemoteGenerator
    from agentrl.generation.server import start_server

    starts = [Start(f"train/0000{i}", i, f"g{i}") for i in range(3)]
    local, _ = _rollout(tiny_generator, "tests.agent_programs:chatty", starts)
    srv = start_server(tiny_generator, "tiny-test", port=0)
    try:
        client = RemoteGenerator(f"http://127.0.0.1:{srv.server_address[1]}")
        client.tokenizer = tiny_generator.tokenizer
        served, stats = _rollout(client, "tests.agent_programs:chatty", starts)
    finally:
        srv.shutdown()
    assert [[(t.prompt_ids, t.gen_ids) for t in e.turns] for e in served] == \
        [[(t.prompt_ids, t.gen_ids) for t in e.turns] for e in local]
    assert [e.score for e in served] == [e.score for e in local]
    assert stats["generate_calls"] == stats["turns"] == 6  # one request per turn, many in flight


def _alive(pid):
    """Running (a zombie is not: it waits only to be reaped by its parent, or by init for an orphan)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_program_that_raises_hangs_dies_or_returns_junk_is_a_failed_episode_and_a_hung_one_is_killed(
        tiny_generator, tmp_path):
    """Each program runs in a worker process of its own: a hung one is killed at its timeout (the process is
    gone, not left running), one that ends its interpreter (os._exit, a segfault) costs its episode only."""
    path, pid_file = tmp_path / "tasks.jsonl", tmp_path / "sleeper.pid"  # its own pid, then its child's
    modes = ("ok", "raise", "sleep", "junk", "exit", "segfault")
    # a timeout with room for the other programs' one request on a loaded machine; the sleeper outlives it
    path.write_text("".join(json.dumps({"question": "q", "mode": m, "sleep_s": 600, "pid_file": str(pid_file)})
                            + "\n" for m in modes))
    envs = InProcessEnvs("agent:tests.agent_programs:by_mode", 6,
                         {"tasks": str(path), "timeout_s": 10, "failure_reward": -1.0})
    cfg = RolloutConfig(max_turns=4, sampling=SamplingParams(temperature=1.0, max_new_tokens=16, seed=3))
    engine = RolloutEngine(tiny_generator, tiny_generator.tokenizer, envs, "agent:tests.agent_programs:by_mode", cfg)
    t0 = time.monotonic()
    eps = engine.run([Start(f"train/0000{i}", 0, f"g{i}") for i in range(len(modes))])
    assert time.monotonic() - t0 < 60  # the sleeper's 600 s were not waited for
    ok, raised, slept, junk, exited, segfault = eps
    assert ok.error == "" and ok.score == 0.5 and ok.turns[-1].reward == 0.5 and ok.won
    assert raised.error == "RuntimeError: the agent's own bug"
    assert slept.error.startswith("TimeoutError") and "timeout_s=10" in slept.error and "killed" in slept.error
    # killed (it ignored SIGTERM), and so is the subprocess it had started: its whole process group
    assert [_alive(int(pid)) for pid in pid_file.read_text().split()] == [False, False]
    assert "must return a finite number" in junk.error
    assert exited.error.startswith("ProgramDied: ") and "exit code 3" in exited.error
    assert segfault.error.startswith("ProgramDied: ") and "SIGSEGV" in segfault.error
    for e in (raised, slept, junk, exited, segfault):  # what it did before it failed is kept, with the failure's reward
        assert len(e.turns) == 1 and e.turns[-1].reward == -1.0 and not e.won and e.turns[-1].info["agent_error"]
    d = episode_diagnostics(eps, lambda e: e.total_reward)
    assert d["agent_failures"] == 5.0 and d["agent_timeouts"] == 1.0 and d["agent_failures/ProgramDied"] == 2.0
    # the run goes on: the next rollout works, on the workers left and fresh ones for those that died
    again = engine.run([Start("train/00000", 1, "g"), Start("train/00003", 1, "g")])
    assert [e.error[:10] for e in again] == ["", "ValueError"] and len(again[0].turns) == 1
    workers, = agent_program._held[envs].pools  # one pool, kept across the two rollouts
    assert workers.stats["killed"] == 1 and workers.stats["died"] == 2 and not workers.busy
    idle = [w.proc for w in workers.idle]
    envs.close()  # the run's envs closed: their workers are stopped
    assert idle and all(p.poll() is not None for p in idle)


def test_rollouts_at_once_on_the_same_envs_each_have_their_own_workers(tok):
    """A collect ahead (the producer thread) may overlap an evaluation on the run's envs: each rollout takes a
    pool of workers of its own, and both are kept for the next rollouts."""
    gen = Scripted(tok, lambda prompt: "Hello there.")
    gen.tokenizer = tok
    envs = InProcessEnvs("agent:tests.agent_programs:chatty", 2, {"tasks": TASKS})
    cfg = RolloutConfig(max_turns=4, sampling=SamplingParams(max_new_tokens=24))
    out = {}

    def roll(name, seed):
        engine = RolloutEngine(gen, tok, envs, "agent:tests.agent_programs:chatty", cfg)
        out[name] = engine.run([Start(f"train/0000{i}", seed, f"{name}{i}") for i in range(2)])

    threads = [threading.Thread(target=roll, args=(n, k)) for k, n in enumerate("ab")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        for name in "ab":
            assert [(e.error, len(e.turns), e.group_id) for e in out[name]] == [("", 2, f"{name}{i}") for i in (0, 1)]
        held = agent_program._held[envs]
        assert len(held.pools) == 2 and len(held.idle) == 2
    finally:
        envs.close()


def test_a_script_without_a_main_guard_runs_its_programs_once(tmp_path, tiny_model_dir):
    """The workers are fresh interpreters that never import the trainer's main script: a script with its
    rollout at the top level (no ``if __name__ == "__main__":``) runs once, not again in every worker."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "train.py"
    script.write_text(f"""
from agentrl.envs.pool import InProcessEnvs
from agentrl.learner.models import load_tokenizer
from agentrl.rollout.engine import RolloutConfig, RolloutEngine, Start
from agentrl.types import SamplingParams
from tests.test_agent_program import Scripted

print("script ran", flush=True)
tok = load_tokenizer({str(tiny_model_dir)!r})
gen = Scripted(tok, lambda prompt: "Hello.")
gen.tokenizer = tok
envs = InProcessEnvs("agent:tests.agent_programs:chatty", 2, {{"tasks": "tests.agent_programs:tasks"}})
engine = RolloutEngine(gen, tok, envs, "agent:tests.agent_programs:chatty",
                       RolloutConfig(max_turns=4, sampling=SamplingParams(max_new_tokens=8)))
print("errors:", [e.error for e in engine.run([Start(f"train/0000{{i}}", 0, "g") for i in range(2)])], flush=True)
""")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("script ran") == 1 and "errors: ['', '']" in out.stdout, out.stdout


def test_a_generator_that_fails_is_the_runs_error_not_the_programs(tok):
    class Broken(Scripted):
        def generate(self, prompts, sampling, seeds=None, choices=None):
            raise RuntimeError("out of memory")

    gen = Broken(tok, None)
    gen.tokenizer = tok
    with pytest.raises(RuntimeError, match="generator failed while agent programs ran: RuntimeError: out of memory"):
        _rollout(gen, "tests.agent_programs:chatty", [Start("train/00000", 0, "g")])


def test_an_async_program_with_the_async_client(tiny_generator):
    eps, _ = _rollout(tiny_generator, "tests.agent_programs:async_agent", [Start("train/00000", 0, "g")])
    assert eps[0].error == "" and len(eps[0].turns) == 1 and eps[0].score == 1.0


def test_the_guides_example_agent_solves_its_tasks_with_a_competent_policy(tok):
    """examples/calc_agent.py through the endpoint: a policy that calls the calculator on the expression and
    answers its result wins every task (the example's tool loop and scoring work)."""
    from tests.agent_programs import competent_calculator

    gen = Scripted(tok, competent_calculator)
    gen.tokenizer = tok
    envs = InProcessEnvs("agent:examples.calc_agent:run_agent", 2, {"tasks": "examples/calc_tasks.jsonl"})
    cfg = RolloutConfig(max_turns=4, sampling=SamplingParams(max_new_tokens=200))
    engine = RolloutEngine(gen, tok, envs, "agent:examples.calc_agent:run_agent", cfg)
    eps = engine.run([Start(f"valid/0000{i}", 0, f"g{i}") for i in range(4)])
    assert [(e.won, e.score, len(e.turns), e.error) for e in eps] == [(True, 1.0, 2, "")] * 4
    assert all(e.turns[0].actions and json.loads(e.turns[0].actions[0])["name"] == "calculator" for e in eps)


# ----- training ------------------------------------------------------------------------------------------------
def _train_keeping_episodes(t, out):
    """Trains ``t`` (closed after) keeping every rollout's episodes: its metrics rows and its training
    episodes (the evaluations' left out)."""
    episodes = []
    rollout = t.sampler.rollout

    def keep(*a, **k):
        eps = rollout(*a, **k)
        episodes.extend(eps)
        return eps

    t.sampler.rollout = keep
    try:
        t.train()
    finally:
        t.close()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, [e for e in episodes if not e.group_id.startswith("eval:")]


@pytest.mark.timeout(300)
def test_an_openai_client_agent_trains_two_grpo_steps_through_the_capture_endpoint(tiny_model_dir, tmp_path):
    from agentrl import Trainer
    from agentrl.config_loader import load_config

    cfg = load_config("grpo", env="agent:tests.agent_programs:chatty", overrides=[
        f"model.name={tiny_model_dir}", f"trainer.out_dir={tmp_path}", "trainer.steps=2", "trainer.tensorboard=false",
        "trainer.progress=false", "rollout.groups=2", "rollout.group_size=4", "rollout.slots=4", "rollout.max_turns=3",
        "rollout.max_new_tokens=24", "eval.tasks=2", "eval.every=2", f"env_kwargs.tasks={TASKS}",
        "rollout.pool=process"])  # the tasks come from env worker processes
    t = Trainer.from_config(cfg)
    gen = Recording(t.generator)
    t.generator = t.sampler.generator = gen
    rows, train = _train_keeping_episodes(t, tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["agent_failures"] == 0.0 and r["turns_per_episode"] == 2.0 and "loss" in r
        # every row is an agent episode's: a whole one where its requests nest, else one request's
        assert r.get("agent_trajectory_samples", 0) + r.get("agent_turn_samples", 0) == r.get("samples", 0)
    assert any(not r.get("skipped_update") for r in rows[1:])
    assert len(train) >= 16 and all(len(e.turns) == 2 for e in train)
    assert all(e.one_sample == turns_nest(e.turns) for e in train)
    returned = {(p, ids): lp for p, ids, lp in gen.rows}
    for e in train:  # every turn is what the generator returned, token for token
        for turn in e.turns:
            full = next(ids for p, ids in returned if p == tuple(turn.prompt_ids)
                        and ids[:len(turn.gen_ids)] == tuple(turn.gen_ids))
            assert tuple(turn.gen_logprobs) == returned[(tuple(turn.prompt_ids), full)][:len(turn.gen_ids)]


@pytest.mark.slow  # two GRPO steps (~50 s on a loaded machine)
def test_a_program_with_a_forced_call_and_a_streamed_answer_trains_two_grpo_steps(tiny_model_dir, tmp_path):
    """tool_choice "required" then a streamed request, through the trainer: every forced turn carries the ids
    its opening was drawn among (gen_allowed) into the update; no episode fails."""
    from agentrl import Trainer
    from agentrl.config_loader import load_config

    cfg = load_config("grpo", env="agent:tests.agent_programs:forced_call", overrides=[
        f"model.name={tiny_model_dir}", f"trainer.out_dir={tmp_path}", "trainer.steps=2", "trainer.tensorboard=false",
        "trainer.progress=false", "rollout.groups=2", "rollout.group_size=4", "rollout.slots=4", "rollout.max_turns=3",
        "rollout.max_new_tokens=56", "eval.tasks=2", "eval.every=2", f"env_kwargs.tasks={TASKS}"])
    t = Trainer.from_config(cfg)
    rows, train = _train_keeping_episodes(t, tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["agent_failures"] == 0.0 and r["turns_per_episode"] == 2.0 and "loss" in r for r in rows[1:])
    assert len(train) == 16 and all(e.turns[0].gen_allowed and not e.turns[1].gen_allowed for e in train)


def test_a_bad_agent_spec_is_one_line_naming_the_key(tiny_model_dir, tmp_path):
    from agentrl.config_loader import load_config
    from agentrl.preflight import preflight
    from agentrl.schema import ConfigError

    def check(env, *overrides):
        cfg = load_config("grpo", env=env, overrides=[f"model.name={tiny_model_dir}", f"trainer.out_dir={tmp_path}",
                                                      *overrides])
        with pytest.raises(ConfigError) as e:
            preflight(cfg)
        return str(e.value)

    assert check("agent:tests.agent_programs:nobody", f"env_kwargs.tasks={TASKS}").startswith("bad value for 'env':")
    assert "no_such_module" in check("agent:no_such_module:fn", f"env_kwargs.tasks={TASKS}")
    assert check("agent:tests.agent_programs:chatty").startswith("bad value for 'env_kwargs': ")
    assert "algo.level" in check("agent:tests.agent_programs:chatty", f"env_kwargs.tasks={TASKS}",
                                 "algo.level=trajectory", "rollout.chat_mode=full")


def test_the_guides_example_is_the_shipped_program():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    guide = (root / "docs/guides/tools.md").read_text()
    snippet = guide[guide.index("def run_agent"):]
    assert snippet[:snippet.index("```")].strip() in (root / "examples/calc_agent.py").read_text()
    assert "agent:examples.calc_agent:run_agent" in guide and "env_kwargs.tasks=examples/calc_tasks.jsonl" in guide


# ----- trajectory-level samples ----------------------------------------------------------------------------
def _agent_batch(episodes, program):
    """GRPO's batch of ``episodes`` (rewards 1, 0, 1, 0...: each group of two differs)."""
    from agentrl.config_loader import load_config
    from agentrl.recipe import RECIPES

    for i, e in enumerate(episodes):
        e.turns[-1].reward = e.score = float(i % 2 == 0)
        e.won = i % 2 == 0
    cfg = load_config("grpo", env=f"agent:{program}", overrides=[f"env_kwargs.tasks={TASKS}"])
    return RECIPES.get(cfg.method)(cfg).make_batch(None, episodes)


def _targets(model, samples):
    """Per sample: the learner's log-prob of each generated token, and the token-mean PPO loss of the rows."""
    import torch

    from agentrl.algos.losses import policy_loss
    from agentrl.learner.batch import collate
    from agentrl.learner.logprobs import token_logprobs

    batch = collate(samples, 0)
    with torch.no_grad():
        lp = token_logprobs(model, batch.input_ids, batch.attention_mask).double()
    per_row = [lp[b][batch.loss_mask[b] > 0].tolist() for b in range(len(samples))]
    loss, _ = policy_loss(lp, batch.old_logprobs.double(), batch.advantages.double(), batch.loss_mask.double())
    return per_row, float(loss)


def test_an_agent_episode_whose_requests_nest_is_one_sample_and_one_that_rewrites_its_history_is_per_request(
        tok, tiny_generator, capsys):
    """Replies appended as returned, under the tiny model's template: every request extends the last token for
    token, so each episode is one row whose generated tokens have the log-probs, advantages and token-mean loss
    of its per-request rows, on fewer tokens. A program that edits an earlier message: one row per request."""
    import copy

    from agentrl.runs.records import episode_record

    gen = Scripted(tok, lambda prompt: f"Move {prompt.count('<|im_start|>user')} left.")
    starts = [Start(f"train/0000{i}", i, f"g{i // 2}") for i in range(4)]
    nested, _ = _rollout(gen, "tests.agent_programs:appending", starts)
    assert [len(e.turns) for e in nested] == [3] * 4 and all(e.one_sample and not e.error for e in nested)
    split = copy.deepcopy(nested)
    for e in split:
        e.one_sample = False  # the same episodes, one row per request
    whole, stats = _agent_batch(nested, "tests.agent_programs:appending")
    rows, split_stats = _agent_batch(split, "tests.agent_programs:appending")
    assert (stats["agent_trajectory_samples"], stats["agent_turn_samples"], len(whole)) == (4.0, 0.0, 4)
    assert (split_stats["agent_trajectory_samples"], split_stats["agent_turn_samples"], len(rows)) == (0.0, 12.0, 12)
    for e, s in zip(nested, whole):  # the one row is the last request's prompt and generation, as sampled
        assert s.ids == e.turns[-1].prompt_ids + e.turns[-1].gen_ids
        assert [lp for lp, m in zip(s.old_logprobs, s.loss_mask) if m] == [lp for t in e.turns for lp in t.gen_logprobs]
        assert [a for a, m in zip(s.advantages, s.loss_mask) if m] == [
            a for r in rows if r.meta["episode"] == s.meta["episode"] for a, m in zip(r.advantages, r.loss_mask) if m]
    one_lp, one_loss = _targets(tiny_generator.model, whole)
    turn_lp, turn_loss = _targets(tiny_generator.model, rows)
    for n, lps in enumerate(one_lp):  # the same weights, the same contexts: the same log-probs and loss
        mine = [lp for r, row_lp in zip(rows, turn_lp) if r.meta["episode"] == n for lp in row_lp]
        assert lps == pytest.approx(mine, abs=1e-5)
    assert one_loss == pytest.approx(turn_loss, abs=1e-6) and one_loss != 0.0
    one_tokens, turn_tokens = sum(len(s.ids) for s in whole) / 4, sum(len(s.ids) for s in rows) / 4
    assert stats["agent_sample_tokens"] == 4 * one_tokens and split_stats["agent_sample_tokens"] == 4 * turn_tokens
    assert one_tokens < 0.6 * turn_tokens
    with capsys.disabled():
        print(f"\ntokens per 3-request episode: {one_tokens:.0f} as one sample, {turn_tokens:.0f} per request")

    edited, _ = _rollout(gen, "tests.agent_programs:rewriting", starts)
    assert [len(e.turns) for e in edited] == [3] * 4 and not any(e.one_sample for e in edited)
    rows, stats = _agent_batch(edited, "tests.agent_programs:rewriting")
    assert (stats["agent_trajectory_samples"], stats["agent_turn_samples"], len(rows)) == (0.0, 12.0, 12)
    # the run's records say which form each episode trained in
    assert [episode_record(e, None, None)["notes"]["one_sample"] for e in (nested[0], edited[0])] == [True, False]


# SmolLM2-135M-Instruct's chat template, as shipped: ChatML that renders neither tools nor an assistant's
# tool_calls (the endpoint writes the calls into the content, as the hermes parser writes them)
SMOLLM2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
                    "'<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                    "{% endif %}")


def test_the_calculator_agent_under_smollm2s_template_trains_one_sample_as_its_requests(tiny_model_dir, tiny_generator):
    """examples/calc_agent.py under SmolLM2's template (a call, its result, an answer; each reply ending with the
    end-of-message id, as a generator samples it): one row per episode whose targets are every request's sampled
    ids, the closing tag and <|im_end|> included, with the per-request rows' advantages, log-probs, token-mean
    loss and gradient. (Seed 1 of docs/guides/tools.md's calculator-agent study collapses into
    <answer>N</answer</answer>: not through a misplaced target or advantage of the one-sample form.)"""
    import copy

    import torch

    from agentrl.algos.losses import policy_loss
    from agentrl.config_loader import load_config
    from agentrl.learner.batch import collate
    from agentrl.learner.logprobs import token_logprobs
    from agentrl.recipe import RECIPES
    from agentrl.rollout.agent_program import renders_tool_calls

    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = SMOLLM2_TEMPLATE
    assert not renders_tool_calls(tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")

    class Policy(Scripted):  # the calculator on the expression, then its result, each reply closed by <|im_end|>
        def generate(self, prompts, sampling, seeds=None, choices=None):
            outs = []
            for p in prompts:
                prompt = self.tok.decode(p)
                if "<|im_start|>tool\n" in prompt:
                    text = f"<answer>{prompt.rsplit('<|im_start|>tool', 1)[1].split('<|im_end|>')[0].strip()}</answer>"
                else:
                    expr = prompt.rsplit("Expression: ", 1)[1].split("<|im_end|>")[0]
                    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % expr
                ids = self.tok(text, add_special_tokens=False)["input_ids"] + [end]
                outs.append(Completion(ids, [-0.1 * (1 + k % 7) for k in range(len(ids))], text, "stop"))
            return outs

    gen = Policy(tok, None)
    gen.tokenizer = tok
    program = "examples.calc_agent:run_agent"
    envs = InProcessEnvs(f"agent:{program}", 2, {"tasks": "examples/calc_tasks.jsonl", "timeout_s": 120})
    engine = RolloutEngine(gen, tok, envs, f"agent:{program}", RolloutConfig(
        max_turns=4, sampling=SamplingParams(max_new_tokens=96)))
    try:
        episodes = engine.run([Start(f"train/{i:05d}", i, f"g{i // 2}") for i in range(4)])
    finally:
        envs.close()
    assert [len(e.turns) for e in episodes] == [2] * 4 and all(e.won and e.one_sample for e in episodes)
    for e in episodes:
        assert all(t.gen_ids[-1] == end for t in e.turns)
        assert tok.decode(e.turns[-1].gen_ids).startswith("<answer>")
    for e in episodes[1::2]:  # each group of two differs: advantages not 0
        e.turns[-1].reward, e.score, e.won = 0.0, 0.0, False
    split = copy.deepcopy(episodes)
    for e in split:
        e.one_sample = False
    cfg = load_config("grpo", env=f"agent:{program}", overrides=[
        "env_kwargs.tasks=examples/calc_tasks.jsonl", "algo.turn_weight=episode"])
    whole, _ = RECIPES.get(cfg.method)(cfg).make_batch(None, episodes)
    rows, _ = RECIPES.get(cfg.method)(cfg).make_batch(None, split)
    assert len(whole) == 4 and len(rows) == 8
    for n, s in enumerate(whole):
        mine = [r for r in rows if r.meta["episode"] == n]
        assert s.ids[-1] == end and s.loss_mask[-1] == 1  # the answer's closing tag and <|im_end|> are targets
        for key in ("ids", "old_logprobs", "advantages"):  # target by target, the per-request rows' values
            assert [v for v, m in zip(getattr(s, key), s.loss_mask) if m] == \
                [v for r in mine for v, m in zip(getattr(r, key), r.loss_mask) if m]
        assert any(s.advantages)

    model = tiny_generator.model

    def targets(samples):
        model.zero_grad()
        batch = collate(samples, 0)
        lp = token_logprobs(model, batch.input_ids, batch.attention_mask).double()
        loss, _ = policy_loss(lp, batch.old_logprobs.double(), batch.advantages.double(), batch.loss_mask.double())
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return [lp[b][batch.loss_mask[b] > 0].tolist() for b in range(len(samples))], float(loss.detach()), grads

    with torch.enable_grad():
        one_lp, one_loss, one_grad = targets(whole)
        row_lp, row_loss, row_grad = targets(rows)
    model.zero_grad()
    for n, lps in enumerate(one_lp):
        assert lps == pytest.approx([v for r, r_lp in zip(rows, row_lp) if r.meta["episode"] == n for v in r_lp],
                                    abs=1e-5)
    assert one_loss == pytest.approx(row_loss, abs=1e-6) and one_loss != 0.0
    torch.testing.assert_close(one_grad, row_grad, atol=1e-5, rtol=1e-4)
    from agentrl.learner.engine import TorchEngine  # the learner's own path: micro-batches, rows packed

    eng = TorchEngine(tiny_model_dir)
    for packed in (True, False):
        eng.cfg.packing = packed
        a, b = collate(whole, eng.pad_id), collate(rows, eng.pad_id)
        got, want = eng.logprobs(a)[a.loss_mask.bool()], eng.logprobs(b)
        want = torch.cat([want[i][b.loss_mask[i].bool()] for r in range(4) for i, s in enumerate(rows)
                          if s.meta["episode"] == r])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
