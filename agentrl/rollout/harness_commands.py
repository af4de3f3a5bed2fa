"""A command per episode (``--env agent:external`` with ``env_kwargs.command``): the trainer starts the user's
command for each episode, a harness that plays that one episode over the gate's HTTP contract
(``agentrl.rollout.harness_gate``) and ends.

The episode is claimed for the command (it is never offered to other harnesses) and handed to it in its
environment (``ENV`` names each variable): its OpenAI base URL and the run's key (also as ``OPENAI_BASE_URL``
and ``OPENAI_API_KEY``, so ``openai.OpenAI()`` with no arguments talks to the episode), the task as JSON,
and where to report the reward. The command reports it as any harness does (``POST $AGENTRL_REWARD_URL``),
or prints it as its standard output's last line (a number or ``{"reward": ..., "success": ...}``) and exits 0.

Each command runs in a process group of its own, its output in files (a pipe nobody reads would block a
chatty command), from the trainer's working directory with its environment. One that exits nonzero, or
exits 0 with no reward, is a failed episode whose error carries its standard error's last line; one still
running at ``timeout_s`` (counted from its start) is killed with its group (SIGKILL, its own subprocesses
too; ``agentrl.rollout.program_workers.kill_group``), as is one still running once its reward is in.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl import hard_exit
from agentrl.envs.agent_program import KEY_ENV
from agentrl.generation.capture import MODEL_NAME
from agentrl.rollout.program_workers import how_ended, kill_group, read_reward

FAILED = "CommandFailed"  # the kind of failure of a command that ended without a reward
POLL_S = 0.1  # how often running commands are looked at (a reward over HTTP is heard at once)
TAIL_BYTES = 4096  # the end of an output file read for its last line
LINE_CHARS = 300  # at most this much of that line in the episode's error

# the variables each command gets (docs/guides/tools.md lists them); the key is $AGENTRL_HARNESS_KEY
ENV = {
    "base_url": "AGENTRL_BASE_URL",  # http://127.0.0.1:PORT/ep/<episode id>/v1
    "gate_url": "AGENTRL_GATE_URL",  # http://127.0.0.1:PORT
    "reward_url": "AGENTRL_REWARD_URL",  # POST {"reward": number, "success": bool} or {"error": "why"} here
    "episode_id": "AGENTRL_EPISODE_ID",
    "task": "AGENTRL_TASK",  # the task's dict as JSON
    "task_id": "AGENTRL_TASK_ID",
    "timeout_s": "AGENTRL_TIMEOUT_S",
    "model": "AGENTRL_MODEL",
}


def last_line(path: Path) -> str:
    """The last non-empty line of a file (its last ``TAIL_BYTES``), at most ``LINE_CHARS``."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            lines = f.read().decode("utf-8", "replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip()[:LINE_CHARS] if lines else ""


@dataclass
class _Running:
    proc: subprocess.Popen
    folder: Path  # its stdout and stderr
    deadline: float
    reported: bool = False  # its reward (or error) came over HTTP: its exit says nothing more


class CommandLane:
    """One rollout's episodes, each played by a command started here; a ``Lane`` of the gate (its
    ``offer``/``wait``/``kill``/``close``, as ``roll_agents`` drives a lane)."""

    def __init__(self, lane: Any, command: tuple[str, ...], timeout_s: float):
        self.lane, self.command, self.timeout_s = lane, command, timeout_s
        self.running: dict[Any, _Running] = {}
        self.stats = {"started": 0, "killed": 0, "failed": 0}
        # a hard exit of the trainer (no stack unwinding) kills them too: their own session outlives ours
        hard_exit.on_exit(id(self), self._kill_all)

    def _kill_all(self) -> None:
        for r in list(self.running.values()):
            kill_group(r.proc, wait_s=1.0)

    def offer(self, key: Any, task: dict[str, Any], eid: str, task_id: str) -> None:
        """Claim the episode for a command and start it (its clock starts now: the claim is in ``wait``)."""
        gate = self.lane.gate
        gate.hand_out(self.lane, key, task, eid, task_id)
        url = gate.local_url()
        values = {"base_url": f"{url}/ep/{eid}/v1", "gate_url": url, "reward_url": f"{url}/episodes/{eid}/reward",
                  "episode_id": eid, "task": json.dumps(task), "task_id": task_id, "timeout_s": f"{self.timeout_s:g}",
                  "model": MODEL_NAME}
        env = {**os.environ, **{ENV[k]: v for k, v in values.items()}, KEY_ENV: gate.key,
               "OPENAI_BASE_URL": values["base_url"], "OPENAI_API_KEY": gate.key}
        folder = Path(tempfile.mkdtemp(prefix="agentrl-command-"))
        try:
            with open(folder / "stdout", "wb") as out, open(folder / "stderr", "wb") as err:
                proc = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        start_new_session=True)
        except OSError as e:  # the program went away since the preflight found it
            shutil.rmtree(folder, ignore_errors=True)
            self.lane.kill(key)
            self.stats["failed"] += 1
            self.lane.events.put((key, {"error": f"{FAILED}: the command could not start ({e})"}))
            return
        self.stats["started"] += 1
        self.running[key] = _Running(proc, folder, time.monotonic() + self.timeout_s)

    def wait(self, timeout: float) -> list[tuple[Any, dict[str, Any] | None]]:
        """The lane's claims and rewards, and a box for each command that ended without reporting."""
        end = time.monotonic() + max(0.0, timeout)
        while True:
            # commands that ended are looked at before the lane's events are read: a reward a command reported
            # before it exited is in them by then (the gate queues it before answering the POST)
            ended = [k for k, r in self.running.items() if r.proc.poll() is not None]
            out = self.lane.wait(0.0 if ended else min(POLL_S, end - time.monotonic()))
            for key, box in out:
                if box is not None and key in self.running:
                    self.running[key].reported = True
            for key in ended:
                r = self.running.pop(key)
                if not r.reported:
                    self.lane.kill(key)  # its late requests are refused
                    self.stats["failed"] += 1
                    out.append((key, self._ended(r)))
                self._reap(r)
            now = time.monotonic()
            for key in [k for k, r in self.running.items() if r.reported and r.deadline <= now]:
                self._reap(self.running.pop(key))  # reported, then still running at its timeout
            if out or now >= end:
                return out

    def _ended(self, r: _Running) -> dict[str, Any]:
        """The episode of a command that ended without reporting over HTTP: the reward it printed last, or
        its failure."""
        said = last_line(r.folder / "stderr")
        tail = f"; its stderr's last line: {said}" if said else " (its stderr is empty)"
        if r.proc.returncode != 0:
            return {"error": f"{FAILED}: the command ended with {how_ended(r.proc.returncode)}{tail}"}
        printed = last_line(r.folder / "stdout")
        try:
            return {"reward": read_reward(json.loads(printed))}
        except ValueError:  # not JSON, or not a reward
            return {"error": f"{FAILED}: the command exited 0 without reporting a reward (POST it to "
                             f"${ENV['reward_url']}, or print it as its stdout's last line; that line is "
                             f"{printed[:80]!r}){tail}"}

    def kill(self, key: Any) -> str:
        """End an episode (its timeout, or the rollout stopped): its command killed with its group. Returns its
        stderr's last line (what it said before it was killed)."""
        self.lane.kill(key)
        r = self.running.pop(key, None)
        if r is None:
            return ""
        self.stats["killed"] += 1
        kill_group(r.proc)
        said = last_line(r.folder / "stderr")
        self._reap(r)
        return said

    @staticmethod
    def _reap(r: _Running) -> None:
        kill_group(r.proc)  # a command that ended may have left subprocesses in its group
        shutil.rmtree(r.folder, ignore_errors=True)

    def close(self) -> None:
        """Kill every command still running (the rollout ended or stopped) and close the lane."""
        for key in list(self.running):
            self.kill(key)
        self.lane.close()
        hard_exit.forget(id(self))
