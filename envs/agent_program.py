"""``agent:pkg.mod:fn``: any agent program as an env. The program, not the rollout engine, drives the
episode: agentrl calls ``fn(task, endpoint)`` for each task with an OpenAI-compatible endpoint in front
of the policy (``agentrl.rollout.agent_program``), and every request it makes is a turn.

This env holds what the rest of a run needs from an env: the tasks (splits and ids, for task draws,
groups and evaluation), each task's payload (the dict handed to ``fn``), and the program's options as its
``PromptSpec`` (``style == "agent"`` tells the rollout engine to hand the episode to the program).

Options (``env_kwargs``):

* ``tasks``: a JSONL file, one JSON object per line (the payload; an optional ``"split"`` of train / valid /
  test, default train; an optional ``"category"``), or ``pkg.mod:fn`` returning a list of such dicts. Task
  ids are ``split/00000`` in the order the tasks come in their split.
* ``timeout_s`` (300): a program still running after this is a failed episode;
* ``failure_reward`` (0.0): the reward of a failed episode (the program raised, timed out or returned
  something that is not a reward), a finite number within ``agentrl.types.REWARD_BOUND``;
* ``tool_parser`` ("hermes"): how the endpoint reads tool calls out of the policy's text
  (``agentrl.rollout.tool_parsers``);
* ``stop_after_failing`` (3): the run stops with one line once every episode of this many rollouts in a row
  failed (each step's collection, dynamic-sampling round and evaluation is one); 0: never.

``agent:external`` runs no program: harnesses started elsewhere claim the episodes over HTTP
(``agentrl.rollout.harness_gate``), with the run's key ``$AGENTRL_HARNESS_KEY``. Its own options:

* ``host`` ("127.0.0.1"): where the gate listens; another address (``0.0.0.0``) only when asked;
* ``port`` (0: a free one, logged): under several ranks, rank N listens on ``port + N``;
* ``command`` (none): a command line (a string, split as a shell would, or a list of arguments) the trainer
  starts for each episode, which gets the episode through environment variables
  (``agentrl.rollout.harness_commands``); with it the key may be left unset (a fresh one per run).
"""
from __future__ import annotations

import json
import math
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from agentrl.envs.base import SPLITS, EnvError, PromptSpec, Task, TextEnv
from agentrl.types import REWARD_BOUND
from agentrl.registry import RegistryError, load_object


@dataclass
class AgentSpec(PromptSpec):
    """An agent program's options, read by the rollout (``agentrl.rollout.agent_program``)."""

    program: str = ""
    timeout_s: float = 300.0
    failure_reward: float = 0.0
    tool_parser: str = "hermes"
    stop_after_failing: int = 3
    host: str = "127.0.0.1"  # agent:external only: where the harness gate listens
    port: int = 0
    command: tuple[str, ...] = ()  # agent:external only: started once per episode (empty: harnesses elsewhere)
    style: str = "agent"


STOP_AFTER_FAILING = AgentSpec.stop_after_failing
EXTERNAL = "external"  # agent:external: the episodes come from harnesses outside the trainer
KEY_ENV = "AGENTRL_HARNESS_KEY"  # agent:external: the run's key, which harnesses send as a Bearer token
MIN_KEY_CHARS = 16
MAX_TIMEOUT_S = 7 * 86400.0  # a week: an infinite timeout overflowed the rollout's wait


# each numeric option's range: (default, test, what is allowed)
OPTIONS: dict[str, tuple[float, Any, str]] = {
    "timeout_s": (300.0, lambda x: 0 < x <= MAX_TIMEOUT_S, f"above 0, at most {MAX_TIMEOUT_S:g} s"),
    "failure_reward": (0.0, lambda x: abs(x) <= REWARD_BOUND,
                       f"a finite reward from {-REWARD_BOUND:g} to {REWARD_BOUND:g}"),
    "stop_after_failing": (STOP_AFTER_FAILING, lambda x: x >= 0 and x == int(x), "0 (never) or a number of rollouts"),
}


def check_options(kwargs: dict[str, Any]) -> dict[str, float]:
    """The numeric options of ``kwargs`` (defaults for those not given) as finite floats within their ranges;
    one EnvError line naming the key otherwise (a NaN or infinite failure_reward was taken and wrote NaN into
    metrics.jsonl). The loader calls it too, so --print-config and --dry-run refuse alike."""
    out = {}
    for key, (default, ok, allowed) in OPTIONS.items():
        value = kwargs.get(key, default)
        try:
            x = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError, OverflowError):
            x = math.nan
        if not (math.isfinite(x) and ok(x)):
            raise EnvError(f"bad value for 'env_kwargs.{key}': {value!r}; allowed: {allowed}")
        out[key] = x
    return out


def check_command(command: Any) -> tuple[str, ...]:
    """``env_kwargs.command`` as the arguments to start (a string is split as a shell would split it, no shell
    runs it); one EnvError line naming the key when it is not a command line whose program is found here."""
    where = "env_kwargs.command must be a command line (\"python my_harness.py\") or a list of its arguments"
    if isinstance(command, str):
        try:
            args = shlex.split(command)
        except ValueError as e:
            raise EnvError(f"{where}; {command[:80]!r} does not split into arguments ({e})") from None
    elif isinstance(command, (list, tuple)) and all(isinstance(a, str) for a in command):
        args = list(command)
    else:
        raise EnvError(f"{where}, got {str(command)[:80]!r} (a {type(command).__name__})")
    if not args or not args[0]:
        raise EnvError(f"{where}, got an empty one")
    if shutil.which(args[0]) is None:
        raise EnvError(f"env_kwargs.command: {args[0]!r} is not an executable file here, nor a program on $PATH")
    return tuple(args)


def check_gate(program: str, host: Any, port: Any, command: Any = None) -> None:
    """``host``/``port``/``command`` are ``agent:external``'s, which needs the run's key (with a command a fresh
    one serves if none is given); one EnvError line naming the key."""
    if program != EXTERNAL:
        given = next((k for k, v in (("host", host), ("port", port), ("command", command)) if v is not None), None)
        if given:
            raise EnvError(f"env_kwargs.{given} is an option of agent:external only (a program's workers reach the "
                           f"endpoint on 127.0.0.1)")
        return
    if command is not None:
        check_command(command)
    if (command is None or os.environ.get(KEY_ENV)) and len(os.environ.get(KEY_ENV, "")) < MIN_KEY_CHARS:
        raise EnvError(f"env 'agent:external' needs ${KEY_ENV}, a key of at least {MIN_KEY_CHARS} characters that "
                       f"harnesses send as 'Authorization: Bearer KEY' (export {KEY_ENV}=$(openssl rand -hex 16))")
    if host is not None and (not isinstance(host, str) or not host or len(host) > 253):
        raise EnvError(f"env_kwargs.host must be an address to listen on (127.0.0.1, 0.0.0.0, ::), got {host!r}")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
        raise EnvError(f"env_kwargs.port must be 0 (a free port) to 65535, got {port!r}")


def load_tasks(source: str) -> list[dict[str, Any]]:
    """The task dicts of a JSONL file or of a ``pkg.mod:fn`` that lists them; one line naming the fault."""
    if Path(source).expanduser().is_file():
        out = []
        for n, line in enumerate(Path(source).expanduser().read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except ValueError as e:
                raise EnvError(f"env_kwargs.tasks: {source} line {n} is not JSON ({e})") from None
            out.append(task)
    elif ":" in source and not source.endswith((".jsonl", ".json")):
        try:
            fn = load_object(source, "env_kwargs.tasks")
        except RegistryError as e:
            raise EnvError(str(e)) from None
        out = list(fn())
    else:
        raise EnvError(f"env_kwargs.tasks: {source!r} is neither a file nor a package.module:function")
    for n, task in enumerate(out, 1):
        if not isinstance(task, dict):
            raise EnvError(f"env_kwargs.tasks: task {n} of {source} is a {type(task).__name__}, not a JSON object")
        if task.get("split", "train") not in SPLITS:
            raise EnvError(f"env_kwargs.tasks: task {n} of {source} has split {task['split']!r}; allowed: "
                           f"{', '.join(SPLITS)}")
    return out


class AgentProgramEnv(TextEnv):
    """The env of ``agent:pkg.mod:fn`` (see the module's doc). It has no steps of its own: ``step`` refuses."""

    name: ClassVar[str] = "agent"

    def __init__(self, program: str = "", tasks: str = "", timeout_s: float = 300.0, failure_reward: float = 0.0,
                 tool_parser: str = "hermes", stop_after_failing: int = STOP_AFTER_FAILING,
                 host: str | None = None, port: int | None = None, command: str | list[str] | None = None,
                 max_steps: int | None = None, **kwargs: Any):
        super().__init__(max_steps=max_steps, **kwargs)  # an unknown option is one line naming it
        if ":" not in program and program != EXTERNAL:
            raise EnvError(f"env 'agent:{program}': the program must look like agent:package.module:function "
                           "(or agent:external: harnesses outside the trainer)")
        check_gate(program, host, port, command)
        if not tasks:
            raise EnvError(f"env 'agent:{program}': env_kwargs.tasks is required (a JSONL file of tasks, or "
                           "package.module:function listing them)")
        opts = check_options({"timeout_s": timeout_s, "failure_reward": failure_reward,
                              "stop_after_failing": stop_after_failing})
        timeout_s, failure_reward, stop_after_failing = (opts[k] for k in OPTIONS)
        self.name = f"agent:{program}"
        self.spec = AgentSpec(system="", instruction="", program=program, timeout_s=timeout_s,
                              failure_reward=failure_reward, tool_parser=tool_parser,
                              stop_after_failing=int(stop_after_failing), host=host or "127.0.0.1",
                              port=port or 0, command=check_command(command) if command is not None else ())
        self._payloads: dict[str, dict[str, Any]] = {}
        self._tasks: dict[str, list[Task]] = {s: [] for s in SPLITS}
        for task in load_tasks(tasks):
            split = task.get("split", "train")
            tid = f"{split}/{len(self._tasks[split]):05d}"
            self._tasks[split].append(Task(tid, split, str(task.get("category", ""))))
            self._payloads[tid] = task

    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            raise EnvError(f"unknown split '{split}'; allowed: {', '.join(SPLITS)}")
        return self._tasks[split]

    def task_payload(self, task_id: str) -> dict[str, Any]:
        """The task as the program receives it (a copy: a program that edits it changes no other episode's)."""
        self.get_task(task_id)
        return json.loads(json.dumps(self._payloads[task_id]))

    def prompt_spec(self) -> PromptSpec:
        return self.spec

    def _reset(self, task: Task, seed: int) -> tuple[str, dict[str, Any]]:
        return json.dumps(self._payloads[task.task_id])[:2000], {"admissible_actions": None}

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        raise EnvError(f"env '{self.name}' is driven by its program: it takes no env steps")
