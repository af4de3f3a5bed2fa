"""Episodes of an agent program (``--env agent:pkg.mod:fn``, ``agentrl.envs.agent_program``).

For each start, ``roll_agents`` opens an episode on the capture endpoint (``agentrl.generation.capture``)
and calls the user's ``fn(task, endpoint)`` in a worker process of its own (``agentrl.rollout.program_workers``),
at most ``len(envs)`` (``rollout.slots``) at once: ``task`` is the task's dict, ``endpoint`` an
``AgentEndpoint`` (its ``base_url`` carries the episode id; ``openai_client()`` is an ``openai.OpenAI``
pointed there). ``fn`` may be ``async def``. It returns the episode's reward: a number (success: > 0), or
``{"reward": float, "success": bool}``. With ``agent:external`` no program runs here: the episodes are
offered to harnesses started elsewhere (``agentrl.rollout.harness_gate``), which report the reward, or with
``env_kwargs.command`` each is handed to a command started for it (``agentrl.rollout.harness_commands``).

Every request the program made is one turn, in the order they were answered: the prompt ids the chat
template made of its messages and tools, and the ids and log-probs the generator sampled, as it returned
them (never re-tokenized), so the learner trains on exactly what was sampled. The reward goes on the last
turn. Where every request's prompt starts with the previous request's prompt and generated ids, token for
token (a program that appends the replies as returned, under a template that renders them back as sampled),
the episode is marked ``Episode.one_sample``: the learner trains it as one sequence, the last prompt and
generation, with each request's generated span masked in (``agentrl.learner.batch.episode_sample``), so the
shared history is processed once rather than once per request; otherwise (a program that edits or drops
earlier messages, a template that re-renders a reply differently from its sampled ids) each request is a
sample of its own. A program that raises, returns something that is not a reward, whose process dies (``os._exit``, a
segfault) or that is still running after ``timeout_s`` (its process is then killed) is a failed episode
(``Episode.error``, counted as ``agent_failures``): its turns so far get ``failure_reward``, the run goes on.
The first failure of each kind (the exception's type) a program has in a run (one generator) is logged as a
warning with its message and the last ``TRACE_FRAMES`` frames of its traceback (the run folder keeps these
lines in ``agent_failures.log``, ``agentrl.run_folder``); every one is counted in the step's metrics as
``agent_failures/<kind>``. When every episode of ``stop_after_failing`` rollouts in a row failed (an
``env_kwargs`` key, default 3), the run stops with one ``EnvError`` line: a program with a bug in every
episode would otherwise train on the failure reward for the whole run. Every request of an episode that has
ended is refused (404). A generator that fails is the run's error: the rollout raises it once the programs
have ended.
"""
from __future__ import annotations

import logging
import math
import shlex
import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from agentrl.envs.agent_program import EXTERNAL
from agentrl.envs.base import EnvError
from agentrl.envs.tools import call_action
from agentrl import hard_exit
from agentrl.generation.capture import MODEL_NAME, CaptureServer, CaptureService, CapturedCall, ParsedReply
from agentrl.registry import load_object
from agentrl.rollout.context import context_length
from agentrl.rollout.episode import EpisodeSteps, Start
from agentrl.rollout.program_workers import (START_TIMEOUT_S, TRACE_CHARS, TRACE_FRAMES, AgentEndpoint,
                                              ProgramWorkers, read_reward, run_program)
from agentrl.rollout.tool_formats import tool_parser
from agentrl.rollout.tool_parsers import BadCall, ToolCall, parse_calls, text_before
from agentrl.rollout.tool_prompts import render_chat, template_support
from agentrl.types import Episode, Turn, turns_nest

MAX_CALLS = 16  # tool calls read out of one reply
__all__ = ["AgentEndpoint", "TRACE_CHARS", "TRACE_FRAMES", "read_reward", "run_program", "roll_agents"]
log = logging.getLogger(__name__)


@dataclass
class _RunFailures:
    """A run's failures so far (one per generator, so a second run in the process shows its own first ones)."""

    reported: set[tuple[str, str]] = field(default_factory=set)  # (program, kind of failure) printed already
    failing: int = 0  # rollouts in a row in which every episode failed


_runs: "weakref.WeakKeyDictionary[Any, _RunFailures]" = weakref.WeakKeyDictionary()


def failures_of(generator: Any) -> _RunFailures:
    try:
        return _runs.setdefault(generator, _RunFailures())
    except TypeError:  # a generator that takes no weak reference: one record for all of them
        return _runs.setdefault(_RunFailures, _RunFailures())  # type: ignore[arg-type]


_PROBE_CALL = "probe_call_\u2063"
_renders_calls: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def renders_tool_calls(tok: Any) -> bool:
    """Whether this tokenizer's chat template writes an assistant message's ``tool_calls`` (Qwen's does; a
    template that renders only ``content`` would drop the calls from the history), probed once."""
    try:
        return _renders_calls[tok]
    except (KeyError, TypeError):
        pass
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": _PROBE_CALL, "arguments": {}}}]}]
    try:
        found = _PROBE_CALL in render_chat(tok, msgs, None, False, generation_prompt=False)
    except Exception:  # a template that raises on tool_calls renders none
        found = False
    try:
        _renders_calls[tok] = found
    except TypeError:
        pass
    return found


def chat_renderer(tok: Any, parser_name: str) -> Any:
    """``render(messages, tools) -> prompt ids`` with the policy's chat template. A template that ignores
    ``tools`` gets the parser's description of them in the system message; one that does not write an
    assistant's ``tool_calls`` sees them in its content as the parser writes them; one without a ``tool``
    role gets results as a user message (as tool envs do, ``agentrl.rollout.tool_prompts``)."""
    parser = tool_parser(parser_name)

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        (tools_ok, role_ok), calls_ok = template_support(tok), renders_tool_calls(tok)
        msgs: list[dict[str, Any]] = []
        results: list[str] = []
        for m in messages:
            if m["role"] == "tool" and not role_ok:
                results.append(m["content"])
                continue
            if results:
                msgs.append({"role": "user", "content": parser.results_text(results)})
                results = []
            if m.get("tool_calls") and not calls_ok:
                calls = [ToolCall(c["function"]["name"], a) if isinstance(a := c["function"]["arguments"], dict)
                         else BadCall("", str(a)) for c in m["tool_calls"]]
                text = parser.render(calls)
                m = {"role": "assistant", "content": f"{m['content']}\n{text}" if m["content"] else text}
            msgs.append(m)
        if results:
            msgs.append({"role": "user", "content": parser.results_text(results)})
        if tools and not tools_ok:
            described = parser.system_text(tools)
            if msgs and msgs[0]["role"] == "system":
                msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{described}"}
            else:
                msgs.insert(0, {"role": "system", "content": described})
        return render_chat(tok, msgs, tools if tools_ok else None, True)

    return render


def call_prefix(parser_name: str) -> Any:
    """``prefix(tool name) -> text``: how the parser's format opens a call of that tool, up to where its
    arguments begin (the common start of its renderings with and without arguments); None where that opening
    does not hold the name (a format that writes the name after the arguments)."""
    parser = tool_parser(parser_name)

    def prefix(name: str) -> str | None:
        try:
            a, b = parser.render([ToolCall(name, {})]), parser.render([ToolCall(name, {"a": 1})])
        except Exception:  # a parser of the user's that cannot render
            return None
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return a[:n] if name in a[:n] else None

    return prefix


def reply_parser(parser_name: str) -> Any:
    """``parse(text) -> ParsedReply``: the calls the registry's parser reads, the text before the first
    call as the message's content."""
    parser = tool_parser(parser_name)
    # a parser of the user's without content(): ToolParser's default reading, by its open_tag
    content_of = parser.content if callable(getattr(parser, "content", None)) else \
        (lambda text: text_before(text, getattr(parser, "open_tag", None)))

    def parse(text: str, tools: list[dict[str, Any]] | None = None) -> ParsedReply:
        found = parse_calls(parser, text, MAX_CALLS, tools)
        if not found.calls:
            return ParsedReply(text)
        return ParsedReply(content_of(text), [(c.name, c.arguments) for c in found.calls if isinstance(c, ToolCall)],
                           [c.error for c in found.calls if isinstance(c, BadCall)])

    return parse


def report_failure(program: str, error: str, trace: str = "", run: _RunFailures | None = None) -> None:
    """Log the first failure of each kind (``error``'s exception type) of ``program`` in ``run``, with its
    traceback."""
    kind = error.split(":", 1)[0]
    reported = (run or failures_of(None)).reported
    if (program, kind) in reported:
        return
    reported.add((program, kind))
    log.warning("agent program %s failed: %s (the first %s shown; each is counted in agent_failures/%s and its "
                "episode gets env_kwargs.failure_reward)%s", program, error, kind, kind,
                f"\n{trace.rstrip()}" if trace else "")


def check_failing(program: str, episodes: list[Episode], stop_after: int, run: _RunFailures) -> None:
    """Count a rollout in which every episode failed; past ``stop_after`` in a row, the run's one-line error."""
    if not episodes or not all(e.error for e in episodes):
        run.failing = 0
        return
    run.failing += 1
    if stop_after and run.failing >= stop_after:
        kinds = Counter(e.error.split(":", 1)[0] for e in episodes)
        raise EnvError(f"agent program {program} failed in every episode of {run.failing} rollouts in a row (the "
                       f"last: {', '.join(f'{n} {k}' for k, n in kinds.most_common())}; {episodes[-1].error[:200]}); "
                       "the first failure of each kind is logged above and in the run folder's agent_failures.log. "
                       "Fix the program and rerun the command (it resumes from the last checkpoint), or set "
                       "env_kwargs.stop_after_failing=0 to train on env_kwargs.failure_reward anyway")


def to_episode(env_name: str, s: Start, task: dict[str, Any], calls: list[CapturedCall], reward: float,
               success: bool, error: str, max_requests: int) -> Episode:
    """The episode the recipes train on: one turn per request, token for token as sampled; one sample when
    the requests nest (see the module's doc)."""
    ep = Episode(env_name, s.task_id, s.seed, s.group_id, str(task.get("category", "")),
                 initial_observation=str(task)[:2000])
    for k, c in enumerate(calls):
        actions = [call_action(n, a) for n, a in c.reply.calls]
        ep.turns.append(Turn(c.prompt_ids, c.ids, c.logprobs, c.text, actions, not c.reply.malformed, "", 0.0, False,
                             c.finish_reason, info={"tool_calls": len(c.reply.calls) + len(c.reply.malformed),
                                                    "tool_errors": len(c.reply.malformed), "request": k},
                             gen_versions=c.completion.versions[:len(c.ids)],
                             gen_allowed=c.completion.allowed[:len(c.ids)]))  # a forced call's opening
    if ep.turns:
        ep.turns[-1].reward, ep.turns[-1].done = reward, True
        if error:
            ep.turns[-1].info["agent_error"] = error
    ep.one_sample = turns_nest(ep.turns)
    ep.won, ep.score, ep.progress = success and not error, reward, reward
    ep.error = error
    ep.truncated = len(calls) >= max_requests and bool(error)
    return ep


NO_CLAIM_S = 30.0  # the longest wait between looks at the deadlines (an unclaimed external episode has none)


class _Held:
    """What serves one envs' agent episodes across rollouts, so its start-up is paid once: program worker pools
    (one per rollout running at once: a collect ahead in the producer thread may overlap an evaluation), or the
    harness gate (one port; each rollout a lane of it)."""

    def __init__(self) -> None:
        self.idle: list[ProgramWorkers] = []
        self.pools: list[ProgramWorkers] = []
        self.gate: Any = None
        self.lock = threading.Lock()

    def take(self, program: str) -> ProgramWorkers:
        with self.lock:
            if self.idle:
                return self.idle.pop()
            self.pools.append(ProgramWorkers(program))
            return self.pools[-1]

    def give_back(self, pool: ProgramWorkers) -> None:
        with self.lock:
            self.idle.append(pool)

    def harness_gate(self, spec: Any) -> Any:
        from agentrl.rollout.harness_gate import harness_gate

        with self.lock:
            if self.gate is None:
                self.gate = harness_gate(spec)
            return self.gate

    def close(self) -> None:
        with self.lock:
            pools, gate, self.pools, self.idle, self.gate = self.pools, self.gate, [], [], None
        for pool in pools:
            pool.close()
        if gate is not None:
            gate.close()


_held: "weakref.WeakKeyDictionary[Any, _Held]" = weakref.WeakKeyDictionary()
_held_lock = threading.Lock()


def held_by(envs: Any) -> _Held:
    """``envs``' ``_Held``, made at its first agent rollout; stopped when the envs close or go, or at a hard
    exit (no program process, no listening port outlives the run)."""
    with _held_lock:
        if (held := _held.get(envs)) is not None:
            return held
        held = _held[envs] = _Held()
    release = weakref.finalize(envs, _release, held)  # runs once, whichever comes first
    hard_exit.on_exit(id(held), held.close)
    if hasattr(envs, "on_close"):  # the trainer closes its envs: what serves them goes first
        envs.on_close(release)
    return held


def _release(held: _Held) -> None:
    hard_exit.forget(id(held))
    held.close()


def roll_agents(steps: EpisodeSteps, generator: Any, envs: Any, starts: list[Start], streams: list[int]
                ) -> list[Episode]:
    """Run the env's agent program once per start (see the module's doc); episodes in ``starts`` order."""
    spec = envs.call(0, "prompt_spec")
    external = spec.program == EXTERNAL
    command = getattr(spec, "command", ())  # agent:external's command per episode (agentrl.rollout.harness_commands)
    if not external:  # checked here too, so a bad name is the run's one line rather than every episode's failure
        fn = load_object(spec.program, f"env 'agent:{spec.program}'")
        if not callable(fn):
            raise TypeError(f"env 'agent:{spec.program}': {spec.program} is not a function")
    cfg, slots = steps.cfg, max(1, len(envs))
    run = failures_of(generator)
    service = CaptureService(generator, steps.tok, cfg.sampling, chat_renderer(steps.tok, spec.tool_parser),
                             reply_parser(spec.tool_parser), context_length(generator), in_flight=slots,
                             call_prefix=call_prefix(spec.tool_parser))
    held = held_by(envs)
    if external:
        runner: Any = held.harness_gate(spec).lane(service)  # this rollout's episodes on the run's gate
        server = None
        if command:  # each played by a command started here
            from agentrl.rollout.harness_commands import CommandLane

            runner = CommandLane(runner, command, spec.timeout_s)
    else:
        runner = held.take(spec.program)
        server = CaptureServer(service)
    out: list[Episode | None] = [None] * len(starts)
    pending = deque(range(len(starts)))
    running: dict[int, tuple[str, float, dict[str, Any], bool]] = {}  # start -> (eid, deadline, task, started)
    t0 = time.perf_counter()
    program = f"external (env_kwargs.command: {shlex.join(command)[:100]})" if command else spec.program

    def launch(i: int) -> None:
        task = envs.call(0, "task_payload", starts[i].task_id)
        eid = service.open(streams[i], cfg.max_turns, live=server is not None)
        if server is None:  # offered to the harnesses: live, and its clock runs, once one claims it
            runner.offer(i, task, eid, starts[i].task_id)
            running[i] = (eid, math.inf, task, False)
            return
        endpoint = AgentEndpoint(server.base_url(eid), server.api_key, starts[i].task_id, spec.timeout_s, MODEL_NAME)
        now = runner.start(i, task, endpoint)  # a new worker starts the program once it has imported it
        running[i] = (eid, time.monotonic() + (spec.timeout_s if now else START_TIMEOUT_S), task, now)

    def finish(i: int, box: dict[str, Any]) -> None:
        eid, _, task, _ = running.pop(i)
        calls = service.end(eid)
        error = box.get("error", "")
        if error:
            report_failure(program, error, box.get("trace", ""), run)
        reward, success = (spec.failure_reward, False) if error else box["reward"]
        out[i] = to_episode(steps.env_name, starts[i], task, calls, reward, success, error, cfg.max_turns)
        steps.stats["turns"] += len(calls)
        steps.stats["generated_tokens"] += sum(len(c.ids) for c in calls)

    def timed_out(started: bool) -> str:
        if command:
            return (f"TimeoutError: the command ran past env_kwargs.timeout_s={spec.timeout_s:g} s (it was killed with "
                    "its process group)")
        if external:
            return (f"TimeoutError: the harness reported no reward within env_kwargs.timeout_s={spec.timeout_s:g} s "
                    "of claiming the episode")
        if started:
            return (f"TimeoutError: the program ran past env_kwargs.timeout_s={spec.timeout_s:g} s (its process was "
                    "killed)")
        return f"TimeoutError: the program's worker process did not start within {START_TIMEOUT_S:g} s"

    try:
        while pending or running:
            while pending and len(running) < slots:
                launch(pending.popleft())
            wait = min(NO_CLAIM_S, min(d for _, d, _, _ in running.values()) - time.monotonic())
            for i, box in runner.wait(wait):
                if i not in running:  # it had timed out already
                    continue
                if box is None:  # the program started (a worker ready, a harness claimed it): its clock runs
                    eid, _, task, _ = running[i]
                    running[i] = (eid, time.monotonic() + spec.timeout_s, task, True)
                else:
                    finish(i, box)
            now = time.monotonic()
            for i in [i for i, (_, d, _, _) in running.items() if d <= now]:
                said = runner.kill(i)  # a command's stderr's last line: what it was doing
                finish(i, {"error": timed_out(running[i][3]) + (f"; its stderr's last line: {said}" if said else "")})
    finally:
        for i in list(running):  # the rollout stopped early (an error, Ctrl-C): no program outlives it
            runner.kill(i)
        if server is not None:
            server.close()
            held.give_back(runner)
        else:
            runner.close()
            service.close()
        steps.stats["generate_calls"] += service.sched.calls
        steps.stats["generate_s"] += service.sched.busy_s
        steps.stats["env_s"] += time.perf_counter() - t0 - service.sched.busy_s
    if service.generator_error is not None:  # the run's generator broke: the run's error, not the programs'
        e = service.generator_error
        raise RuntimeError(f"the generator failed while agent programs ran: {type(e).__name__}: {e}") from e
    episodes = [e for e in out if e is not None]
    check_failing(program, episodes, getattr(spec, "stop_after_failing", 0), run)
    return episodes
