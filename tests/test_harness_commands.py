"""`--env agent:external` with `env_kwargs.command`: the trainer starts a command per episode, which plays it over
the gate's contract (agentrl.rollout.harness_commands); one that fails, hangs or reports nothing is a failed
episode whose error says why."""
import json
import os
import sys
import time
from pathlib import Path

import pytest

from agentrl.envs.agent_program import KEY_ENV
from agentrl.envs.pool import InProcessEnvs
from agentrl.learner.models import load_tokenizer
from agentrl.rollout import agent_program
from agentrl.rollout.engine import RolloutConfig, RolloutEngine, Start
from agentrl.types import SamplingParams
from tests.test_harness_gate import KEY, ROOT, TASKS, Scripted, _check_rows, _train_with_harness

COMMAND = [sys.executable, str(ROOT / "tests" / "harness_command.py")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie is dead, waiting for its parent


@pytest.mark.timeout(120)
def test_each_episode_is_a_command_and_its_failures_say_why(tmp_path, tiny_model_dir, monkeypatch, caplog):
    monkeypatch.delenv(KEY_ENV, raising=False)  # with a command a fresh key serves: the commands are handed it
    pid_file = tmp_path / "pids"
    modes = ["report", "print", "fail", "hang", "silent"]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"question": f"Push box {i}.", "mode": m, "pid_file": str(pid_file)}) + "\n"
                             for i, m in enumerate(modes)))
    tok = load_tokenizer(tiny_model_dir)
    envs = InProcessEnvs("agent:external", len(modes), {"tasks": str(tasks), "timeout_s": 10, "failure_reward": -1.0,
                                                        "command": COMMAND})
    cfg = RolloutConfig(max_turns=3, sampling=SamplingParams(max_new_tokens=24))
    engine = RolloutEngine(Scripted(tok, "Paris."), tok, envs, "agent:external", cfg)
    t0 = time.monotonic()
    report, printed, fail, hang, silent = engine.run([Start(f"train/{i:05d}", 0, f"g{i}") for i in range(len(modes))])
    assert time.monotonic() - t0 < 60
    gate = agent_program._held[envs].gate
    assert gate.url.startswith("http://127.0.0.1:") and len(gate.key) >= 16  # loopback, and keyed all the same
    assert report.error == "" and report.score == 0.0 and len(report.turns) == 2  # "Paris." has no "o"
    assert printed.error == "" and printed.won and printed.score == 1.0 and len(printed.turns) == 2
    assert fail.error == ("CommandFailed: the command ended with exit code 3; its stderr's last line: ValueError: "
                          "the harness's own bug") and fail.score == -1.0
    assert hang.error == ("TimeoutError: the command ran past env_kwargs.timeout_s=10 s (it was killed with its "
                          "process group); its stderr's last line: still thinking") and hang.score == -1.0
    assert silent.error.startswith("CommandFailed: the command exited 0 without reporting a reward (POST it to "
                                   "$AGENTRL_REWARD_URL, or print it as its stdout's last line")
    parent, child = map(int, pid_file.read_text().split())
    assert not _alive(parent) and not _alive(child)  # the hanging command and its own subprocess are gone
    said = caplog.text  # the first failure of each kind is printed, with its message
    assert "agent program external (env_kwargs.command: " in said and "ValueError: the harness's own bug" in said
    assert "TimeoutError: the command ran past" in said
    envs.close()


@pytest.mark.timeout(400)
def test_a_command_per_episode_trains_two_grpo_steps(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    rows, _, _ = _train_with_harness(tmp_path, tiny_model_dir, None, command=COMMAND)
    _check_rows(rows)


@pytest.mark.parametrize("command, said", [
    ('"python \'x"', "env_kwargs.command must be a command line (\"python my_harness.py\") or a list of its arguments; "
                     "\"python 'x\" does not split into arguments (No closing quotation)"),
    ("5", "env_kwargs.command must be a command line"),
    ("''", "env_kwargs.command must be a command line (\"python my_harness.py\") or a list of its arguments, got an "
           "empty one"),
    ("no-such-harness-program", "env_kwargs.command: 'no-such-harness-program' is not an executable file here, "
                                "nor a program on $PATH"),
    (None, "env 'agent:external' needs $AGENTRL_HARNESS_KEY"),  # no command: harnesses need the run's key
])
def test_a_malformed_command_is_one_line_naming_the_key_before_any_folder(tmp_path, capsys, tiny_model_dir,
                                                                           monkeypatch, command, said):
    from agentrl.cli import main

    monkeypatch.delenv(KEY_ENV, raising=False)
    run = tmp_path / "run"
    for extra in ([], ["--print-config"], ["--dry-run"]):
        rc = main(["train", "grpo", "--env", "agent:external", "--out", str(run), f"model.name={tiny_model_dir}",
                   f"env_kwargs.tasks={TASKS}", *([f"env_kwargs.command={command}"] if command else []), *extra])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and said in err, (extra, err, capsys.readouterr())
        assert not run.exists()


def test_the_command_is_agent_external_s_and_a_given_key_is_still_checked(monkeypatch):
    from agentrl.envs.base import EnvError
    from agentrl.envs.registry import make

    with pytest.raises(EnvError, match="env_kwargs.command is an option of agent:external only"):
        make("agent:tests.agent_programs:chatty", tasks=TASKS, command="python x.py")
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(EnvError, match="at least 16 characters"):
        make("agent:external", tasks=TASKS, command=COMMAND)
    monkeypatch.delenv(KEY_ENV)
    assert make("agent:external", tasks=TASKS, command=f"{sys.executable} -c pass").spec.command == (
        sys.executable, "-c", "pass")


@pytest.mark.timeout(120)
def test_the_guides_command_harness_plays_an_episode(tmp_path, tiny_model_dir, monkeypatch):
    guide = (ROOT / "docs/guides/tools.md").read_text()
    code = guide[guide.index("task = json.loads(os.environ[\"AGENTRL_TASK\"])"):]
    harness = tmp_path / "my_harness.py"
    harness.write_text("import json, os\nimport httpx, openai\n\n" + code[:code.index("```")])
    monkeypatch.setenv(KEY_ENV, KEY)
    tok = load_tokenizer(tiny_model_dir)
    envs = InProcessEnvs("agent:external", 1, {"tasks": TASKS, "command": f"{sys.executable} {harness}"})
    engine = RolloutEngine(Scripted(tok, "Bonjour."), tok, envs, "agent:external",
                           RolloutConfig(max_turns=3, sampling=SamplingParams(max_new_tokens=24)))
    (ep,) = engine.run([Start("train/00000", 0, "g0")])
    assert ep.error == "" and ep.won and ep.score == 1.0 and len(ep.turns) == 1
    envs.close()
