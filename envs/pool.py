"""Env worker pool: one env per process, batched steps, per-step timeouts, crash recovery.

Every slot keeps a journal of what was done to its env (reset, restore, steps with the fingerprints
they produced, reseeds). When a worker dies or hangs past its timeout it is killed and restarted, and
the journal is replayed in the new process with fingerprint checks, so the episode continues exactly
where it was. If the replay diverges or the worker keeps failing, the episode is *dropped*: the step
result says so (``info["dropped"]``), ``stats["dropped"]`` counts it, and the slot refuses further steps
until it is reset. Errors that are the caller's fault (``EnvError``: unknown task, bad option) are
raised in the caller, not retried.

Both pools also take one slot's request at a time without blocking (``submit``, ``envs/slots.py``): a
thread per slot makes the batched call for that slot alone; slots share nothing but the counters.
"""
from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from agentrl.envs.base import EnvError
from agentrl.envs.replay import DivergenceError, Trace
from agentrl.envs.results import StepResult
from agentrl.envs.slots import SlotThreads


@dataclass
class _Slot:
    proc: Any = None
    conn: Any = None
    journal: list[tuple] = field(default_factory=list)  # ("reset", task, seed, fp) | ("step", a, fp) | ("reseed", s)
    dropped: bool = False


# ----------------------------------------------------------------------------------------------------
# worker side


def _worker_main(conn: Any, env_name: str, env_kwargs: dict[str, Any]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    from agentrl.envs.registry import make

    env = None
    try:
        env = make(env_name, **env_kwargs)
        conn.send(("ok", None))
        while True:
            cmd, args = conn.recv()
            if cmd == "close":
                break
            try:
                conn.send(("ok", _handle(env, cmd, args)))
            except EnvError as e:
                conn.send(("env_error", e))
            except Exception:  # an env bug or a dead engine: the parent restarts us
                conn.send(("crash", traceback.format_exc()))
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass
    except Exception:
        try:
            conn.send(("crash", traceback.format_exc()))
        except Exception:
            pass
    finally:
        if env is not None:
            env.close()


def _handle(env: Any, cmd: str, args: Any) -> Any:
    if cmd == "reset":
        return env.reset(*args)
    if cmd == "step":
        return env.step(args)
    if cmd == "journal":
        return _replay_journal(env, args)
    if cmd == "call":
        name, a, kw = args
        return getattr(env, name)(*a, **kw)
    raise EnvError(f"unknown worker command {cmd!r}")


def _replay_journal(env: Any, journal: list[tuple]) -> tuple[str, dict[str, Any]]:
    obs, info = "", {}
    for _i, op in enumerate(journal):
        if op[0] == "reset":
            obs, info = env.reset(op[1], op[2])
        elif op[0] == "step":
            obs, _, _, _, info = env.step(op[1])
        elif op[0] == "reseed":
            env.reseed(op[1])
            continue
        expected = op[-1]
        if expected is not None and info["fingerprint"] != expected:
            raise DivergenceError(env.name, env.task.task_id if env.task else "?", env.steps, expected,
                                  info["fingerprint"], obs)
    return obs, info


# ----------------------------------------------------------------------------------------------------
# parent side


def _last_line(why: Any) -> str:
    """A traceback's or an error's last line, short enough for a run's summary."""
    return (str(why).strip().splitlines() or ["?"])[-1][:300]


class JournalledSlots(SlotThreads):
    """The base of pools whose envs live elsewhere (worker processes, Ray actors): their lifecycle and the
    slots API. Lifecycle: settings and counters (``_setup``), every worker started at once or none
    (``_start``), failures counted with why (``_trouble``), ``close`` (also on ``with`` and at garbage
    collection). Slots API: every slot keeps a journal (reset or restore, steps with fingerprints) that a
    replacement worker replays. A subclass gives ``slots``, ``_create(w)`` / ``_await_ready(w)`` ("" or
    why not) for its workers, ``_shutdown()``, and ``_run({slot: (op, arg)}, timeout)``, which answers
    ``{slot: (status, payload)}`` with status ``ok``, ``drop`` or ``env_error``."""

    worker_name = "worker"  # how a lost worker is named in errors
    slots: list[Any]

    # ----- lifecycle ---------------------------------------------------------------------------------
    def _setup(self, env_name: str, env_kwargs: dict[str, Any] | None, step_timeout: float,
               start_timeout: float, max_restarts: int) -> None:
        self.env_name, self.env_kwargs = env_name, dict(env_kwargs or {})
        self.step_timeout, self.start_timeout, self.max_restarts = step_timeout, start_timeout, max_restarts
        self.stats = {"restarts": 0, "replayed": 0, "dropped": 0, "timeouts": 0, "crashes": 0}
        self._count_lock = threading.Lock()  # submit() runs slots' requests in threads of their own
        self.last_error = ""  # why a worker was last restarted, for the run's summary

    def _start(self, workers: int) -> None:
        """Create every worker, then wait for each (they start in parallel); on any failure the ones
        started are stopped and the error is raised."""
        try:
            for w in range(workers):
                self._create(w)
            for w in range(workers):
                why = self._await_ready(w)
                if why:
                    raise EnvError(f"env worker for '{self.env_name}' failed to start: {why}")
        except BaseException:
            self.close()
            raise

    def _create(self, w: int) -> None:
        raise NotImplementedError

    def _await_ready(self, w: int) -> str:
        raise NotImplementedError

    def _shutdown(self) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.slots)

    def _count(self, key: str) -> None:
        with self._count_lock:
            self.stats[key] += 1

    def _trouble(self, status: str, why: Any) -> tuple[str, Any]:
        """Count a timed-out or crashed request and keep why, for the run's summary."""
        self._count("timeouts" if status == "timeout" else "crashes")
        self.last_error = _last_line(why)
        return status, why

    def close(self) -> None:
        """Let the slot threads finish, then stop every worker (safe to call twice, or half started)."""
        self._close_slot_threads()
        self._shutdown()

    def __enter__(self) -> "JournalledSlots":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ----- slots API ---------------------------------------------------------------------------------

    def _collect(self, answers: dict[int, tuple[str, Any]], on_ok: Any) -> dict[int, StepResult]:
        """Book every slot's answer first, then raise the callers' errors, so no slot's journal is lost."""
        out, errors = {}, []
        for i, (status, payload) in answers.items():
            if status == "drop":
                self._count("dropped")
                self.slots[i].dropped, self.slots[i].journal = True, []
                out[i] = StepResult("", 0.0, True, False, {"dropped": True, "drop_reason": payload})
            elif status == "env_error":
                errors.append(payload)
            else:
                out[i] = on_ok(i, payload)
        if errors:
            raise errors[0]
        return out

    def reset(self, requests: dict[int, tuple[str, int]]) -> dict[int, StepResult]:
        """``{slot: (task_id, seed)}`` -> ``{slot: StepResult}`` (reward 0, not done) for each slot."""
        for i in requests:
            self.slots[i].journal, self.slots[i].dropped = [], False

        def ok(i: int, payload: Any) -> StepResult:
            obs, info = payload
            self.slots[i].journal = [("reset", *requests[i], info["fingerprint"])]
            return StepResult(obs, 0.0, False, False, info)

        return self._collect(self._run({i: ("reset", r) for i, r in requests.items()}, self.start_timeout), ok)

    def restore(self, requests: dict[int, tuple[Trace, int, int | None]]) -> dict[int, StepResult]:
        """``{slot: (trace, t, reseed)}``: rebuild the state after ``t`` actions of ``trace`` by replay."""
        journals = {}
        for i, (trace, t, reseed) in requests.items():
            if not trace.fingerprints or not 0 <= t <= len(trace.actions):
                raise EnvError(f"restore needs a trace with fingerprints and 0 <= t <= {len(trace.actions)}")
            j: list[tuple] = [("reset", trace.task_id, trace.seed, trace.fingerprints[0])]
            j += [("step", a, fp) for a, fp in zip(trace.actions[:t], trace.fingerprints[1:t + 1])]
            if reseed is not None:
                j.append(("reseed", reseed))
            journals[i] = j
            self.slots[i].journal, self.slots[i].dropped = [], False

        def ok(i: int, payload: Any) -> StepResult:
            obs, info = payload
            self.slots[i].journal = journals[i]
            return StepResult(obs, 0.0, False, False, info)

        return self._collect(self._run({i: ("journal", j) for i, j in journals.items()}, self.start_timeout), ok)

    def step(self, actions: dict[int, str]) -> dict[int, StepResult]:
        """One action per slot, all in parallel."""
        for i in actions:
            if self.slots[i].dropped or not self.slots[i].journal:
                raise EnvError(f"slot {i}: step() without a live episode (reset or restore it first)")

        def ok(i: int, payload: Any) -> StepResult:
            obs, reward, term, trunc, info = payload
            self.slots[i].journal.append(("step", actions[i], info["fingerprint"]))
            return StepResult(obs, reward, term, trunc, info)

        return self._collect(self._run({i: ("step", a) for i, a in actions.items()}, self.step_timeout), ok)

    def call(self, slot: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a side-effect-free env method where the slot's env lives (e.g. ``expert_action``)."""
        status, payload = self._run({slot: ("call", (method, args, kwargs))}, self.step_timeout)[slot]
        if status == "drop":
            raise EnvError(f"slot {slot}: {self.worker_name} lost during call to {method}: {payload}")
        if status == "env_error":
            raise payload
        return payload


class EnvPool(JournalledSlots):
    """``num_slots`` env processes of one registered env, addressed by slot index."""

    def __init__(self, env_name: str, num_slots: int, env_kwargs: dict[str, Any] | None = None,
                 step_timeout: float = 60.0, start_timeout: float = 180.0, max_restarts: int = 2,
                 start_method: str = "spawn"):
        self._setup(env_name, env_kwargs, step_timeout, start_timeout, max_restarts)
        self.ctx = mp.get_context(start_method)
        self.slots = [_Slot() for _ in range(num_slots)]
        self._start(num_slots)

    # ----- process management ------------------------------------------------------------------
    def _create(self, i: int) -> None:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker_main, args=(child, self.env_name, self.env_kwargs), daemon=True,
                                name=f"agentrl-env-{self.env_name}-{i}")
        proc.start()
        child.close()
        self.slots[i].proc, self.slots[i].conn = proc, parent

    def _await_ready(self, i: int) -> str:
        status, payload = self._recv(i, self.start_timeout)
        return "" if status == "ok" else str(payload)

    def _kill(self, i: int) -> None:
        s = self.slots[i]
        if s.proc is not None and s.proc.is_alive():
            s.proc.kill()
        if s.proc is not None:
            s.proc.join(5)
        if s.conn is not None:
            s.conn.close()
        s.proc = s.conn = None

    def pid(self, slot: int) -> int:
        return self.slots[slot].proc.pid

    def _recv(self, i: int, timeout: float) -> tuple[str, Any]:
        conn = self.slots[i].conn
        try:
            if not conn.poll(timeout):
                return self._trouble("timeout", f"no answer within {timeout:.0f}s")
            msg = conn.recv()
        except (EOFError, OSError, ConnectionResetError) as e:
            return self._trouble("crash", f"worker died ({type(e).__name__})")
        if msg[0] == "crash":  # the env raised in the worker: its traceback's last line says why
            self._trouble("crash", msg[1])
        return msg

    def _send(self, i: int, msg: tuple) -> bool:
        try:
            self.slots[i].conn.send(msg)
            return True
        except (BrokenPipeError, OSError):
            return False

    # ----- the request/recover cycle -----------------------------------------------------------
    def _request_many(self, requests: dict[int, tuple[str, Any]], timeout: float) -> dict[int, tuple[str, Any]]:
        """Send all requests first (workers run in parallel), then collect each answer."""
        sent = {i: self._send(i, req) for i, req in requests.items()}
        deadline = time.monotonic() + timeout
        out = {}
        for i in requests:
            if not sent[i]:
                out[i] = self._trouble("crash", "worker pipe closed")
                continue
            out[i] = self._recv(i, max(0.0, deadline - time.monotonic()))
        return out

    def _recover(self, i: int, req: tuple[str, Any], timeout: float) -> tuple[str, Any]:
        """Restart slot i's worker, replay its journal, then retry ``req``; drop after max_restarts."""
        last = ""
        for _ in range(self.max_restarts):
            self._kill(i)
            self._count("restarts")
            self._create(i)
            why = self._await_ready(i)
            if why:
                last = f"env worker for '{self.env_name}' failed to start: {why}"
                continue
            if self.slots[i].journal:
                self._count("replayed")
                if not self._send(i, ("journal", self.slots[i].journal)):
                    continue
                status, payload = self._recv(i, self.start_timeout)
                if status == "env_error" and isinstance(payload, DivergenceError):
                    return "drop", str(payload)  # this episode cannot be rebuilt
                if status != "ok":
                    last = str(payload)
                    continue
            if not self._send(i, req):
                continue
            status, payload = self._recv(i, timeout)
            if status in ("ok", "env_error"):
                return status, payload
            last = str(payload)
        return "drop", last

    def _run(self, requests: dict[int, tuple[str, Any]], timeout: float) -> dict[int, tuple[str, Any]]:
        answers = self._request_many(requests, timeout)
        for i, (status, _) in list(answers.items()):
            if status in ("timeout", "crash"):
                answers[i] = self._recover(i, requests[i], timeout)
        return answers

    def _shutdown(self) -> None:
        for i, s in enumerate(getattr(self, "slots", [])):
            if s.conn is not None:
                self._send(i, ("close", None))
        for i, s in enumerate(getattr(self, "slots", [])):
            if s.proc is not None:
                s.proc.join(5)
            self._kill(i)


class InProcessEnvs(SlotThreads):
    """The ``EnvPool`` interface over envs living in this process: no isolation, no crash recovery,
    no process start-up. For tests, benchmarks and cheap envs; use ``EnvPool`` for real runs."""

    def __init__(self, env_name: str, num_slots: int, env_kwargs: dict[str, Any] | None = None):
        from agentrl.envs.registry import make

        self.envs = [make(env_name, **(env_kwargs or {})) for _ in range(num_slots)]
        self.stats = {"restarts": 0, "replayed": 0, "dropped": 0, "timeouts": 0, "crashes": 0}
        self.last_error = ""  # no workers, nothing to restart

    def __len__(self) -> int:
        return len(self.envs)

    def reset(self, requests: dict[int, tuple[str, int]]) -> dict[int, StepResult]:
        return {i: StepResult(*self._pair(self.envs[i].reset(t, s))) for i, (t, s) in requests.items()}

    @staticmethod
    def _pair(out: tuple[str, dict[str, Any]]) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return out[0], 0.0, False, False, out[1]

    def restore(self, requests: dict[int, tuple[Trace, int, int | None]]) -> dict[int, StepResult]:
        from agentrl.envs.replay import replay

        return {i: StepResult(*self._pair(replay(self.envs[i], tr, t, reseed))) for i, (tr, t, reseed) in
                requests.items()}

    def step(self, actions: dict[int, str]) -> dict[int, StepResult]:
        return {i: StepResult(*self.envs[i].step(a)) for i, a in actions.items()}

    def call(self, slot: int, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.envs[slot], method)(*args, **kwargs)

    def close(self) -> None:
        self._close_slot_threads()
        for env in self.envs:
            env.close()

    def __enter__(self) -> "InProcessEnvs":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
