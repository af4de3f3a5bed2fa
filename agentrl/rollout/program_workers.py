"""Agent programs in worker processes: each episode's ``fn(task, endpoint)`` runs in a process of its own.

A thread of the trainer could not be killed at its timeout (it was left running, requests refused) and a
program that crashed the interpreter (``os._exit``, a segfault in a native library) took the run with it.
Here each running episode has one process: a fresh interpreter (``python -c``, not a fork: the trainer holds
torch, CUDA and server threads; not ``multiprocessing``'s spawn either, which re-runs the main script, so a
training script without an ``if __name__ == "__main__":`` guard would start training again in every worker)
with the trainer's ``sys.path`` and working directory, in a process group of its own. A process that finishes
its episode takes the next one (its imports are paid once); one that outlives its timeout is killed with its
group (SIGKILL: the program's own subprocesses too), one that dies is replaced, and either costs that episode
only. The program reaches the capture endpoint over loopback HTTP, with the URL and key of its ``AgentEndpoint``.

This module imports no torch, server or tokenizer code: the workers import it (and the program) only.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from pathlib import Path
from typing import Any

from agentrl.types import REWARD_BOUND

TRACE_FRAMES = 8  # frames of a failed program's traceback that are printed (the innermost ones)
TRACE_CHARS = 4000  # and at most this much of it (a chained or deep one is cut from the top)
START_TIMEOUT_S = 120.0  # a worker that has not imported the program by then is a failed episode
DIED = "ProgramDied"  # the kind of failure of a program whose process ended without an answer


@dataclass(frozen=True)
class AgentEndpoint:
    """What an agent program gets with its task: an OpenAI base URL and key for this episode."""

    base_url: str  # http://127.0.0.1:PORT/ep/<episode id>/v1
    api_key: str
    task_id: str
    timeout_s: float
    model: str = "policy"  # any model name is accepted; the rollout passes the one /v1/models lists

    def openai_client(self) -> Any:
        """An ``openai.OpenAI`` client for this episode (no retries: a refused request is the program's to see)."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=self.timeout_s)


def read_reward(result: Any) -> tuple[float, bool]:
    """(reward, success) of what a program returned; a ``ValueError`` saying what is wrong otherwise."""
    if isinstance(result, dict) and "reward" in result:
        reward, success = result["reward"], result.get("success")
    else:
        reward, success = result, None
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward) \
            or abs(reward) > REWARD_BOUND:  # 1e308 overflowed the batch's statistics (a 44-line traceback)
        raise ValueError(f"the program returned {str(result)[:80]!r}; it must return a finite number within "
                         f"+-{REWARD_BOUND:g} (agentrl.types.REWARD_BOUND) or {{'reward': float, 'success': bool}}")
    return float(reward), bool(success) if success is not None else reward > 0


def run_program(fn: Any, task: dict[str, Any], endpoint: Any) -> dict[str, Any]:
    """``fn(task, endpoint)`` run to its end: ``{"reward": (reward, success)}``, or ``{"error": "Type: message",
    "trace": the innermost frames}`` when it raised or returned something that is not a reward."""
    try:
        result = fn(task, endpoint)
        if inspect.iscoroutine(result):  # an ``async def`` program: an event loop of its own
            result = asyncio.run(result)
    except BaseException as e:  # the program's failure is its episode's, never the run's
        return {"error": f"{type(e).__name__}: {str(e)[:500]}",
                "trace": "".join(traceback.format_exception(e, limit=-TRACE_FRAMES))[-TRACE_CHARS:]}
    try:
        return {"reward": read_reward(result)}
    except ValueError as e:  # a return value that is not a reward: no traceback of the program's to show
        return {"error": f"ValueError: {str(e)[:500]}"}


def _worker_main(fd: int, program: str) -> None:
    """A worker (``python -c``, its pipe to the trainer on ``fd``): take the trainer's ``sys.path``, import the
    program, say so, then run one episode per message until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    conn = Connection(fd)
    try:
        sys.path[:] = conn.recv()  # where the trainer imports from: the program is found as it would be there
        from agentrl.registry import load_object

        try:  # the client most programs use, imported before the clock starts (seconds on a loaded machine)
            import openai  # noqa: F401
        except ImportError:
            pass
        try:
            fn: Any = load_object(program, f"env 'agent:{program}'")
            loaded = None
        except BaseException as e:  # every episode of this worker reports it (preflight normally caught it)
            fn, loaded = None, {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        conn.send(("ready", None))
        while (job := conn.recv()) is not None:
            conn.send(("done", loaded or run_program(fn, *job)))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):  # the trainer is gone: so are we
        pass


# the worker's first line: this agentrl (where it is imported from here) first on its path until it has the
# trainer's; no environment variable, which the program's own subprocesses would inherit
_START = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r}); "
          "from agentrl.rollout.program_workers import _worker_main; _worker_main(int(sys.argv[1]), sys.argv[2])")


def how_ended(exitcode: int | None) -> str:
    """``killed by SIGSEGV`` or ``exit code 3``: how a process ended, from its ``returncode``."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def died(exitcode: int | None) -> str:
    """The failure of a program whose process ended before it answered, as ``Episode.error`` says it."""
    return f"{DIED}: the program's process ended before the program returned ({how_ended(exitcode)})"


def kill_group(proc: subprocess.Popen, wait_s: float = 10.0) -> None:
    """Kill ``proc``'s process group (``proc`` started with ``start_new_session``: SIGKILL, which nothing
    ignores, reaches its own subprocesses too, also those left behind once it has ended: its pid names the
    group until every member is gone) and wait for ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is empty
        pass
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:  # stuck in the kernel (a D-state read): the OS will reap it
        pass


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    ready: bool = False


class ProgramWorkers:
    """Worker processes for one program, reused across episodes and rollouts (see the module's doc).

    ``start(key, task, endpoint)`` hands an episode to an idle worker (a new one when none is idle) and says
    whether its program started at once (a new worker says so later, through ``wait``, once it has imported
    the program: the program's timeout counts from there, not from the interpreter's start-up).
    ``wait(timeout)`` answers ``[(key, None)]`` for a program that just started and ``[(key, box)]`` for one
    that ended (``run_program``'s box; a process that died: ``{"error": "ProgramDied: ..."}``).
    ``kill(key)`` ends an episode's process now (its timeout); ``close()`` stops them all."""

    def __init__(self, program: str):
        self.program = program
        self.idle: list[_Worker] = []
        self.busy: dict[Any, _Worker] = {}
        self.stats = {"started": 0, "killed": 0, "died": 0}

    def _spawn(self) -> _Worker:
        parent, child = mp.Pipe()
        proc = subprocess.Popen([sys.executable, "-c", _START, str(child.fileno()), self.program],
                                pass_fds=(child.fileno(),), start_new_session=True, stdin=subprocess.DEVNULL)
        child.close()
        parent.send(list(sys.path))
        self.stats["started"] += 1
        return _Worker(proc, parent)

    def start(self, key: Any, task: dict[str, Any], endpoint: Any) -> bool:
        w = self.idle.pop() if self.idle else self._spawn()
        try:
            w.conn.send((task, endpoint))
        except (BrokenPipeError, OSError):  # an idle worker that died between episodes: a fresh one
            self._reap(w)
            w = self._spawn()
            w.conn.send((task, endpoint))
        self.busy[key] = w
        return w.ready

    def pid(self, key: Any) -> int:
        return self.busy[key].proc.pid

    def wait(self, timeout: float) -> list[tuple[Any, dict[str, Any] | None]]:
        if not self.busy:
            return []
        by = {w.conn: key for key, w in self.busy.items()}  # a pipe is readable with an answer, or at its end
        out: list[tuple[Any, dict[str, Any] | None]] = []
        for conn in wait_any(list(by), max(0.0, timeout)):
            key = by[conn]
            w = self.busy[key]
            try:
                while conn.poll():
                    kind, box = conn.recv()
                    if kind == "ready":
                        w.ready = True
                        out.append((key, None))
                    else:
                        self.idle.append(self.busy.pop(key))
                        out.append((key, box))
                        break
            except (EOFError, OSError):  # the process ended without an answer: a crash of the program's
                self.stats["died"] += 1
                self._reap(self.busy.pop(key))
                out.append((key, {"error": died(w.proc.returncode)}))
        return out

    def kill(self, key: Any) -> None:
        """End ``key``'s process at once (SIGKILL: a program may ignore anything milder) and reap it."""
        w = self.busy.pop(key, None)
        if w is not None:
            self.stats["killed"] += 1
            self._reap(w)

    @staticmethod
    def _reap(w: _Worker) -> None:
        """Kill the worker's process group (the program's own subprocesses too) and wait for the worker."""
        kill_group(w.proc)
        w.conn.close()

    def close(self) -> None:
        """Stop every worker (an idle one has nothing to finish: killed with its group, as a busy one; safe to
        call twice)."""
        for key in list(self.busy):
            self.kill(key)
        for w in self.idle:
            self._reap(w)
        self.idle = []
