"""The capture endpoint: an OpenAI-compatible chat-completions server in front of any ``Generator`` that
records what an agent program made the policy sample, per episode.

An agent program (``--env agent:pkg.mod:fn``, ``agentrl.rollout.agent_program``) gets a base URL that
carries its episode id in the path, ``http://127.0.0.1:PORT/ep/<episode id>/v1``, and an API key; any
OpenAI client pointed there works unchanged. ``POST /ep/<id>/v1/chat/completions`` (tools accepted,
``n`` 1) applies the policy's chat template to the messages and tools (the caller's ``render``), samples
one completion through the run's generator (batched with the other episodes' requests by
``agentrl.generation.scheduler``), parses its tool calls (the caller's ``parse(text, tools)``: the tool
parser registry) and answers OpenAI's ``tool_calls``; it records the prompt ids, the sampled ids and their
log-probs under the episode id, one record per request. ``stream: true`` is the same generation, recorded,
then sent as ``chat.completion.chunk`` events (``stream_chunks``). ``POST /ep/<id>/v1/responses`` is the
Responses API translated onto the same path (``agentrl.generation.responses_api``). ``GET
/ep/<id>/v1/models`` lists the policy.

Every request field is honoured, taken as ``check_fields`` says, or a 400 naming it, never ignored.
Sampling is the run's (``rollout.temperature``, ``top_p``, ``max_new_tokens``): the learner scores the
tokens under that temperature, so a request's ``temperature``/``top_p``/``seed`` are overridden (named in the
reply's ``agentrl-overridden`` header). A request's ``max_tokens``/``max_completion_tokens`` (at most the
run's) and ``stop`` cut the sampled tokens after the fact, which draws exactly the tokens a shorter
generation would have. ``tool_choice`` ``"none"`` reads no call; ``"required"`` and a named tool draw the
reply's opening among the allowed tools' call openings (``call_prefix``, constrained decoding), then let the
policy write the arguments; JSON ``response_format`` is refused (a schema's values cannot be listed as choices).
An unknown or closed episode is a 404; a request past the episode's budget (``max_requests``), beyond the
context or malformed is a 4xx naming the field, and touches no other request.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from agentrl.generation import responses_api
from agentrl.generation.requests import (BadRequest, ServerLimits, ToolChatBody, check_chat_size, parse_body,
                                        template_messages)
from agentrl.generation.scheduler import scheduler_for
from agentrl.generation.server import RunningServer, _ApiKey, _read_body, install_error_handlers, serve_app
from agentrl.seeds import mix_seed
from agentrl.types import Completion, SamplingParams

log = logging.getLogger(__name__)
# (asked, cap) pairs warned about in this process: a program asks the same max_tokens in every request of a run
_warned_caps: set[tuple[int, int]] = set()


def warn_over_cap(asked: int | None, cap: int) -> None:
    """Once per process and value: a request's ``max_tokens`` above ``rollout.max_new_tokens`` is served at the
    cap, which cut an example's calls silently (it asked 96 while the run capped at 48)."""
    if asked is None or asked <= cap or (asked, cap) in _warned_caps:
        return
    _warned_caps.add((asked, cap))
    log.warning("an agent program asked max_tokens=%d, above rollout.max_new_tokens=%d: its replies are cut at %d "
                "(set rollout.max_new_tokens=%d to give it what it asks)", asked, cap, cap, asked)

MODEL_NAME = "policy"  # what /v1/models lists; any model name in a request is accepted
SHUTTING_DOWN = "the capture endpoint is shutting down (the rollout has ended)"


@dataclass
class ParsedReply:
    """A completion's text read as an assistant message: its content (the text without the calls) and its
    calls as (name, arguments); ``malformed``: the calls that could not be read (why, for each)."""

    content: str
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)


# Fields of a chat request the endpoint takes beyond those it acts on: they describe the caller, never the
# completion (OpenAI's own uses: abuse tracking, caching, storage, billing tier), so nothing of the reply changes
INFORMATIONAL = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
# Sampling is the run's (the learner scores the tokens under it): these are taken and overridden, and a reply
# names the ones a request set in its ``agentrl-overridden`` header
OVERRIDDEN = ("temperature", "top_p", "seed")
# Fields at their OpenAI default change nothing and are taken; any other value is refused with this reason
_DEFAULT_ONLY = {
    "frequency_penalty": (0, "a penalty samples from another distribution than the run's, which the learner "
                             "scores"),
    "presence_penalty": (0, "a penalty samples from another distribution than the run's, which the learner scores"),
    "logit_bias": ({}, "a bias samples from another distribution than the run's, which the learner scores"),
    "top_logprobs": (0, "only the sampled token's log-prob is returned"),
}
_CONSTRAINED = ("the constrained decoding served here (the envs' choice_token_ids) picks among token sequences "
                "listed in advance, so it cannot hold a free-form completion to")
_REFUSED = {
    "response_format": f"JSON output is not served: {_CONSTRAINED} a JSON schema; ask for JSON in the messages "
                       "and parse the reply",
    "functions": "the deprecated functions API is not served: send 'tools'",
    "function_call": "the deprecated functions API is not served: send 'tools' (and 'tool_choice')",
}
STREAM_OPTIONS = ("include_usage",)


def check_fields(body: ToolChatBody) -> None:
    """Every field of ``body`` is one the endpoint honours (or takes, as ``INFORMATIONAL`` and
    ``OVERRIDDEN`` say): otherwise a ``BadRequest`` naming it and why, never a field silently ignored."""
    for name, value in (body.model_extra or {}).items():
        if value is None or name in INFORMATIONAL:
            continue  # null is OpenAI's "not given"
        if name in _DEFAULT_ONLY:
            default, why = _DEFAULT_ONLY[name]
            if value == default and type(value) is not bool:
                continue
            raise BadRequest(f"'{name}' is not served here ({why}); only {default!r} or null is taken", name)
        if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue  # text is what every reply is
        raise BadRequest(f"'{name}' is not served on the capture endpoint: " + _REFUSED.get(
            name, "the endpoint refuses every field it does not honour (docs/guides/tools.md lists them)"), name)
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, dict) and choice not in ("auto", "none", "required"):
        raise BadRequest(f"'tool_choice' must be 'auto', 'none', 'required' or {{'type': 'function', 'function': "
                         f"{{'name': ...}}}}, got {choice[:40]!r}", "tool_choice")
    if body.max_completion_tokens is not None:
        if body.max_completion_tokens < 1:
            raise BadRequest(f"'max_completion_tokens' must be at least 1, got {body.max_completion_tokens}",
                             "max_completion_tokens")
        if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
            raise BadRequest("'max_tokens' and 'max_completion_tokens' say the same thing: give one, or both equal",
                             "max_completion_tokens")
    if body.stream_options is not None:
        if not body.stream:
            raise BadRequest("'stream_options' is only taken with 'stream': true", "stream_options")
        extra = [k for k in body.stream_options if k not in STREAM_OPTIONS]
        if extra or not isinstance(body.stream_options.get("include_usage", False), bool):
            raise BadRequest(f"'stream_options' takes {{'include_usage': true|false}} only, got "
                             f"{json.dumps(body.stream_options)[:80]}", "stream_options")


def forced_tools(body: ToolChatBody) -> list[str] | None:
    """The tools a call must be to (``tool_choice`` "required": any of the request's; a named one: that one),
    or None when the policy is free to call or not. A name the request's tools do not hold is a 400."""
    choice, names = body.tool_choice, [t["function"]["name"] for t in body.tools or []]
    if choice == "required":
        if not names:
            raise BadRequest("'tool_choice' is 'required' but the request has no 'tools'", "tool_choice")
        return names
    if not isinstance(choice, dict):
        return None
    # chat: {"type": "function", "function": {"name": ...}}; Responses: {"type": "function", "name": ...}
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise BadRequest(f"'tool_choice' as an object must name a function ({{'type': 'function', 'function': "
                         f"{{'name': ...}}}}), got {json.dumps(choice)[:80]}", "tool_choice")
    if name not in names:
        raise BadRequest(f"'tool_choice' names {name[:60]!r}, which is not among the request's tools", "tool_choice")
    return [name]


def joined(first: Completion, rest: Completion, tok: Any) -> Completion:
    """A forced call's opening (drawn among the allowed tools' openings) and the policy's free continuation,
    as one completion: the opening's tokens keep the ids they were drawn among (``allowed``), so the learner
    scores them under that constraint; the continuation's are the whole vocabulary's."""
    ids = first.ids + rest.ids
    versions = first.versions + rest.versions if first.versions and rest.versions else []
    return Completion(ids, first.logprobs + rest.logprobs, tok.decode(ids, skip_special_tokens=True),
                      rest.finish_reason, list(first.allowed), versions)


def honour(reply: ParsedReply, text: str, body: ToolChatBody) -> ParsedReply:
    """The parsed reply as the request's ``tool_choice``/``parallel_tool_calls`` allow: under ``none`` no
    call is read (the whole text is the content); under ``parallel_tool_calls: false`` only the first call
    is, and each further one is recorded as malformed (counted in ``tool_errors``), never returned."""
    if body.tool_choice == "none":
        return ParsedReply(text)
    if body.parallel_tool_calls is False and len(reply.calls) + len(reply.malformed) > 1:
        first = reply.calls[:1]
        dropped = len(reply.calls) - len(first)
        return ParsedReply(reply.content, first, reply.malformed + [
            "parallel_tool_calls is false: a call after the first was dropped"] * dropped)
    return reply


def overridden(body: ToolChatBody) -> list[str]:
    """The sampling fields a request set that the run's sampling overrode."""
    return [f for f in OVERRIDDEN if f in body.model_fields_set]


@dataclass
class CapturedCall:
    """One request of an episode: the prompt ids the template made, what the generator sampled for them
    (ids and log-probs as it returned them) and how the reply read."""

    prompt_ids: list[int]
    completion: Completion
    ids: list[int]  # the sampled ids the reply stands for: ``completion.ids`` cut at max_tokens / a stop string
    logprobs: list[float]
    text: str
    finish_reason: str
    reply: ParsedReply


@dataclass
class _Episode:
    stream: int
    max_requests: int
    calls: list[CapturedCall] = field(default_factory=list)
    requests: int = 0  # requests taken (answered or in flight): the next one's index and sampling seed
    # Responses API: each response's conversation (its input and output), for a later previous_response_id
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def cut(c: Completion, tokenizer: Any, max_tokens: int, stop: list[str]) -> tuple[list[int], str, str]:
    """(ids, text, finish reason) of ``c`` as a generation with ``max_tokens`` and ``stop`` strings would
    have ended: after the token that completes a stop string, or after ``max_tokens`` tokens."""
    ids, reason = list(c.ids), c.finish_reason
    if len(ids) > max_tokens:
        ids, reason = ids[:max_tokens], "length"
    if stop and any(s in tokenizer.decode(ids, skip_special_tokens=True) for s in stop):
        for k in range(1, len(ids) + 1):  # the first token whose text completes a stop string
            text = tokenizer.decode(ids[:k], skip_special_tokens=True)
            hit = min((text.index(s) for s in stop if s in text), default=-1)
            if hit >= 0:
                return ids[:k], text[:hit], "stop"
    text = c.text if ids == c.ids else tokenizer.decode(ids, skip_special_tokens=True)
    return ids, text, reason


class CaptureService:
    """Episodes, their records and the request handling (see the module's doc). ``render(messages,
    tools) -> prompt ids`` and ``parse(text, tools) -> ParsedReply`` come from the rollout side (chat template and
    tool parser); ``in_flight``: how many episodes run at once (the scheduler's lanes for a server)."""

    def __init__(self, generator: Any, tokenizer: Any, sampling: SamplingParams,
                 render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[int]],
                 parse: Callable[[str, Any], ParsedReply], context: int | None = None, in_flight: int = 1,
                 limits: ServerLimits | None = None, call_prefix: Callable[[str], str | None] | None = None):
        self.tok, self.sampling, self.render, self.parse = tokenizer, sampling, render, parse
        # the text a call of a given tool opens with, up to its arguments (the parser's format): what a forced
        # tool_choice constrains the first tokens to; None: tool_choice required/named is refused
        self.call_prefix = call_prefix
        self.context = context
        self.limits = limits or ServerLimits()
        self.sched = scheduler_for(generator, SamplingParams(**{**sampling.to_dict(), "stop": []}), in_flight,
                                   constrained=call_prefix is not None)
        self.episodes: dict[str, _Episode] = {}
        self.api_key = secrets.token_urlsafe(24)
        self.stats = {"requests": 0, "refused": 0}
        # the generator's first failure: not the program's fault, so the rollout raises it (rollout/agent_program.py)
        self.generator_error: BaseException | None = None
        self.closing = False  # set by close(): a request that reaches the generator after it is answered 503
        self._lock = threading.Lock()
        self._waiting: set[str] = set()  # episodes opened with live=False, not yet played

    # ----- episodes ------------------------------------------------------------------------------
    def open(self, stream: int, max_requests: int, live: bool = True) -> str:
        """A new episode id (unguessable); its requests sample from ``stream`` (seed of request k:
        ``mix_seed(stream, k)``, as a rollout turn's). ``live=False``: no client plays it yet (an episode
        offered to harnesses), so the scheduler does not wait for its requests until ``go_live``."""
        eid = uuid.uuid4().hex
        with self._lock:
            self.episodes[eid] = _Episode(stream, max_requests)
            if not live:
                self._waiting.add(eid)
            self.sched.live = len(self.episodes) - len(self._waiting)
        return eid

    def go_live(self, eid: str) -> None:
        with self._lock:
            self._waiting.discard(eid)
            self.sched.live = len(self.episodes) - len(self._waiting)

    def end(self, eid: str) -> list[CapturedCall]:
        """The episode's records, in the order they were answered; its later requests are refused (404)."""
        with self._lock:
            ep = self.episodes.pop(eid, None)
            self._waiting.discard(eid)
            self.sched.live = len(self.episodes) - len(self._waiting)
        return [] if ep is None else ep.calls

    def close(self) -> None:
        """Stop the scheduler once the requests it holds are answered (the server is shutting down)."""
        self.closing = True
        self.sched.close()

    # ----- requests ------------------------------------------------------------------------------
    def _episode(self, eid: str) -> _Episode:
        ep = self.episodes.get(eid)
        if ep is None:
            raise BadRequest(f"no open episode '{eid[:40]}' (it ended, or the base URL is wrong)", status=404)
        return ep

    def forced(self, body: ToolChatBody) -> list[list[int]] | None:
        """The token ids each allowed tool's call opens with, when ``tool_choice`` forces a call."""
        names = forced_tools(body)
        if names is None:
            return None
        prefixes = [self.call_prefix(n) for n in names] if self.call_prefix is not None else [None]
        if any(p is None for p in prefixes):
            raise BadRequest(f"'tool_choice': {json.dumps(body.tool_choice)[:80]} is not served with this run's tool "
                             "parser (it writes no call opening to constrain to); 'auto' and 'none' are served",
                             "tool_choice")
        return [self.tok(p, add_special_tokens=False)["input_ids"] for p in prefixes]

    def prepare(self, eid: str, raw: bytes) -> tuple[ToolChatBody, list[int], int, list[list[int]] | None]:
        """(the body, its prompt ids, the request's index in its episode, the forced call openings or None),
        or a ``BadRequest``."""
        ep = self._episode(eid)
        body: ToolChatBody = parse_body(ToolChatBody, raw)
        if body.n != 1:
            raise BadRequest("'n' must be 1 here: each request is one turn of the episode", "n")
        if body.echo or body.choice_token_ids is not None:
            raise BadRequest("'echo' and 'choice_token_ids' are not served on the capture endpoint",
                             "echo" if body.echo else "choice_token_ids")
        check_fields(body)
        check_chat_size(body, self.context)  # every part bounded before the template or tokenizer runs
        msgs = template_messages(body)
        try:
            ids = self.render(msgs, body.tools or None)
        except BadRequest:
            raise
        except Exception as e:  # the template refused these messages (roles out of order, a missing field)
            raise BadRequest(f"the chat template cannot render these messages: {type(e).__name__}: "
                             f"{str(e)[:300]}", "messages") from None
        forced = self.forced(body)
        # a forced call's free part is drawn after its opening, with the run's new tokens again
        opening = max((len(f) for f in forced), default=0) if forced else 0
        if self.context and len(ids) + opening + self.sampling.max_new_tokens > self.context:
            raise BadRequest(f"the prompt has {len(ids)} tokens: with the run's {self.sampling.max_new_tokens} new "
                             f"tokens{f' and a forced call opening of {opening}' if opening else ''} it does not fit "
                             f"the model's context of {self.context} tokens", "messages")
        if body.max_completion_tokens is not None:  # OpenAI's newer name for max_tokens (checked equal above)
            body.max_tokens = body.max_completion_tokens
        if body.max_tokens is not None and body.max_tokens < 1:
            raise BadRequest(f"'max_tokens' must be at least 1, got {body.max_tokens}", "max_tokens")
        warn_over_cap(body.max_tokens, self.sampling.max_new_tokens)
        budget = min(body.max_tokens or self.sampling.max_new_tokens, self.sampling.max_new_tokens)
        if opening >= budget:  # the opening and at least one token of the call within the reply's tokens
            raise BadRequest(f"'tool_choice': a call's opening takes {opening} tokens, which leaves none of the "
                             f"reply's {budget} (max_tokens, at most rollout.max_new_tokens) for its arguments",
                             "tool_choice")
        with self._lock:
            ep = self._episode(eid)
            if ep.requests >= ep.max_requests:
                raise BadRequest(f"this episode has made its {ep.max_requests} requests (rollout.max_turns)",
                                 status=429)
            k = ep.requests
            ep.requests += 1
        return body, ids, k, forced

    def prepare_response(self, eid: str, raw: bytes) -> tuple[ToolChatBody, list[int], int, dict[str, Any],
                                                                list[dict[str, Any]]]:
        """A Responses API request as ``prepare`` takes it, plus its body and its conversation so far."""
        try:
            body = json.loads(raw or b"{}")
        except ValueError as e:
            raise BadRequest(f"the request body is not valid JSON ({e})") from None
        except RecursionError:
            raise BadRequest("the request body is nested too deeply") from None
        chat, conversation = responses_api.to_chat(body, self._episode(eid).responses)
        try:
            raw = json.dumps(chat).encode()
        except RecursionError:  # a tool's schema or a metadata value nested past the encoder's limit
            raise BadRequest("the request body is nested too deeply") from None
        return (*self.prepare(eid, raw), body, conversation)

    def keep_response(self, eid: str, rid: str, conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            if (ep := self.episodes.get(eid)) is not None:
                ep.responses[rid] = conversation

    def answer(self, eid: str, body: ToolChatBody, prompt: list[int], k: int, c: Completion) -> dict[str, Any]:
        """Record request ``k``'s completion under its episode and shape the OpenAI reply."""
        max_tokens = min(body.max_tokens or self.sampling.max_new_tokens, self.sampling.max_new_tokens)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        ids, text, reason = cut(c, self.tok, max_tokens, stop)
        # the request's tool schemas type tag-per-argument formats' values; tool_choice "none" reads no call
        reply = honour(ParsedReply(text) if body.tool_choice == "none" else self.parse(text, body.tools), text, body)
        logprobs = list(c.logprobs[:len(ids)])
        with self._lock:
            ep = self.episodes.get(eid)
            if ep is None:  # the episode ended (its program timed out) while this request was sampled
                raise BadRequest(f"episode '{eid[:40]}' ended while this request ran", status=404)
            ep.calls.append(CapturedCall(prompt, c, ids, logprobs, text, reason, reply))
            self.stats["requests"] += 1
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.calls:
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                      "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}}
                                     for n, a in reply.calls]
            reason = "tool_calls"
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": reason,
                                  "token_ids": ids}  # our extension, as on /v1/completions
        if body.logprobs:
            choice["logprobs"] = {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None,
                                               "top_logprobs": []} for t, lp in zip(ids, logprobs)]}
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion", "created": int(time.time()),
                "model": MODEL_NAME, "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                          "total_tokens": len(prompt) + len(ids)}}

    def seed(self, eid: str, k: int) -> int | None:
        ep = self.episodes.get(eid)
        return None if ep is None or self.sampling.seed is None else mix_seed(ep.stream, k)


def _pieces(tok: Any, ids: list[int], content: str) -> list[tuple[str, list[int]]]:
    """``content`` (the reply's text before any call) cut where the sampled tokens end, as (text, ids) pairs:
    a piece's text is what its tokens added to ``content``; a token that does not end a whole character (a
    split UTF-8 byte) joins the next. The ids left over (a call's tokens) come back with empty text."""
    out: list[tuple[str, list[int]]] = []
    done, start = 0, 0
    for k in range(1, len(ids) + 1):
        if done >= len(content):
            break
        text = tok.decode(ids[:k], skip_special_tokens=True)
        if len(text) > done and content.startswith(text[:len(content)]) and not text.endswith("\ufffd"):
            end = min(len(text), len(content))
            out.append((content[done:end], ids[start:k]))
            done, start = end, k
    if done < len(content):  # text the tokens did not line up with (never for a reply read from these ids)
        out.append((content[done:], []))
    if start < len(ids):
        out.append(("", ids[start:]))
    return out


def stream_chunks(tok: Any, body: ToolChatBody, reply: dict[str, Any]) -> list[bytes]:
    """``reply`` (the whole answer, already recorded) as OpenAI's Server-Sent Events: a role chunk, the
    content token by token (each chunk's ``token_ids``, our extension, are the ids it stands for: together
    the recorded ids), the tool calls whole in one delta, the finish reason, the usage when
    ``stream_options.include_usage``, then ``[DONE]``."""
    choice, msg = reply["choices"][0], reply["choices"][0]["message"]
    base = {"id": reply["id"], "object": "chat.completion.chunk", "created": reply["created"], "model": reply["model"]}
    usage = bool((body.stream_options or {}).get("include_usage"))
    lps = iter((choice.get("logprobs") or {}).get("content") or [])

    def chunk(delta: dict[str, Any], ids: list[int], finish: str | None = None) -> bytes:
        c: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "token_ids": ids,
                             "logprobs": {"content": [next(lps) for _ in ids]} if body.logprobs and ids else None}
        return b"data: " + json.dumps({**base, "choices": [c], **({"usage": None} if usage else {})},
                                      ensure_ascii=False).encode() + b"\n\n"

    out = [chunk({"role": "assistant", "content": ""}, [])]
    pieces = _pieces(tok, choice["token_ids"], msg["content"] or "")
    rest: list[int] = pieces.pop()[1] if pieces and not pieces[-1][0] else []
    out += [chunk({"content": text}, ids) for text, ids in pieces]
    if msg.get("tool_calls"):
        out.append(chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]}, rest))
        rest = []
    out.append(chunk({}, rest, choice["finish_reason"]))
    if usage:
        out.append(b"data: " + json.dumps({**base, "choices": [], "usage": reply["usage"]}).encode() + b"\n\n")
    return out + [b"data: [DONE]\n\n"]


NOT_SERVED = {
    "messages": "Anthropic's messages API (POST /v1/messages) is not served: send OpenAI's POST "
                ".../v1/chat/completions",
}


def make_capture_app(service: CaptureService) -> FastAPI:
    app = FastAPI(title="agentrl capture", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_ApiKey, key=service.api_key)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ep/{eid}/v1/models")
    async def models(eid: str) -> dict[str, Any]:
        service._episode(eid)
        return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "max_model_len": service.context}]}

    async def _chat(eid: str, request: Request, responses: bool = False) -> Response:
        raw = await _read_body(request, service.limits)
        try:
            # rendering the template may take a while: off the event loop, so other episodes are not held up
            if responses:
                body, prompt, k, forced, rbody, conversation = await run_in_threadpool(service.prepare_response,
                                                                                       eid, raw)
            else:
                body, prompt, k, forced = await run_in_threadpool(service.prepare, eid, raw)
        except BadRequest:
            service.stats["refused"] += 1
            raise
        if service.closing:  # the scheduler takes no more requests: this one would wait for the cancellation
            raise BadRequest(SHUTTING_DOWN, status=503)
        try:
            seed = service.seed(eid, k)
            outs = await asyncio.wrap_future(service.sched.submit(prompt, seed, forced))
            if forced:  # the opening drawn among the tools' openings, then the policy's call, free
                rest = await asyncio.wrap_future(service.sched.submit(
                    prompt + outs.ids, None if seed is None else mix_seed(seed, 1)))
                outs = joined(outs, rest, service.tok)
        except Exception as e:
            if not service.closing:
                service.generator_error = service.generator_error or e
            raise
        reply = await run_in_threadpool(service.answer, eid, body, prompt, k, outs)
        headers = {"agentrl-overridden": ",".join(o)} if (o := overridden(body)) else None
        if responses:
            out, said = responses_api.to_response(reply, rbody)
            service.keep_response(eid, out["id"], conversation + [said])
            if rbody.get("stream"):
                return StreamingResponse(iter(responses_api.stream_events(out)), media_type="text/event-stream",
                                         headers=headers)
            return JSONResponse(out, headers=headers)
        if body.stream:  # generated whole, recorded, then sent as chunks
            chunks = await run_in_threadpool(stream_chunks, service.tok, body, reply)
            return StreamingResponse(iter(chunks), media_type="text/event-stream", headers=headers)
        return JSONResponse(reply, headers=headers)

    @app.post("/ep/{eid}/v1/chat/completions")
    async def chat(eid: str, request: Request) -> Response:
        return await _guarded(eid, request, False)

    @app.post("/ep/{eid}/v1/responses")
    async def responses(eid: str, request: Request) -> Response:
        return await _guarded(eid, request, True)

    async def _guarded(eid: str, request: Request, responses: bool) -> Response:
        try:
            return await _chat(eid, request, responses)
        except asyncio.CancelledError:
            if not service.closing:
                raise
            # the endpoint stopped with this request in flight, and uvicorn cancelled it past its grace period:
            # answered 503, not a traceback per request (40 in flight printed 2,000 lines)
            return JSONResponse({"error": {"message": SHUTTING_DOWN, "type": "unavailable", "param": None,
                                           "code": 503}}, status_code=503)

    @app.post("/ep/{eid}/{rest:path}")
    async def not_served(eid: str, rest: str) -> JSONResponse:
        # Anthropic's client appends /v1/messages to its base URL: .../v1/v1/messages lands here too
        api = rest.rstrip("/").rsplit("/", 1)[-1]
        raise BadRequest(NOT_SERVED.get(api, f"no route /ep/<id>/{rest[:80]}"), status=404)

    return app


class CaptureServer:
    """A running capture endpoint on 127.0.0.1 (a free port): ``base_url(eid)`` is an episode's OpenAI
    base URL, ``api_key`` the key it needs; ``close()`` stops it."""

    def __init__(self, service: CaptureService, host: str = "127.0.0.1", port: int = 0):
        self.service = service
        self._server: RunningServer = serve_app(make_capture_app(service), service, host, port)
        h, p = self._server.server_address
        self.root = f"http://{h}:{p}"

    @property
    def api_key(self) -> str:
        return self.service.api_key

    def base_url(self, eid: str) -> str:
        return f"{self.root}/ep/{eid}/v1"

    def close(self) -> None:
        self._server.server_close()

