"""A command per episode (`--env agent:external env_kwargs.command=...`), as tests/test_harness_commands.py has the
trainer start it: it reads its episode from its environment, plays it with tests/harness_client.play (the official
`openai` client), then does what the task's "mode" says: report the reward over HTTP (the default), print it as
its stdout's last line, exit 3 with a message on stderr, exit 0 with no reward, or hang (ignoring SIGTERM, with a
subprocess of its own; both pids written to the task's "pid_file")."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from harness_client import play  # this folder is sys.path[0]


def main() -> None:
    env = os.environ
    task, key = json.loads(env["AGENTRL_TASK"]), env["AGENTRL_HARNESS_KEY"]
    mode = task.get("mode", "report")
    print(f"episode {env['AGENTRL_TASK_ID']}: {mode}", file=sys.stderr, flush=True)
    if mode == "fail":
        print("ValueError: the harness's own bug", file=sys.stderr)
        sys.exit(3)
    if mode == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only a kill ends it
        child = subprocess.Popen(["sleep", "600"])
        Path(task["pid_file"]).write_text(f"{os.getpid()} {child.pid}")
        print("still thinking", file=sys.stderr, flush=True)
        time.sleep(600)
    # openai.OpenAI() with no arguments reaches the episode (OPENAI_BASE_URL, OPENAI_API_KEY)
    assert str(openai.OpenAI().base_url).rstrip("/") == env["AGENTRL_BASE_URL"], openai.OpenAI().base_url
    ep = {"base_url": env["AGENTRL_BASE_URL"], "model": env["AGENTRL_MODEL"], "task": task,
          "episode_id": env["AGENTRL_EPISODE_ID"]}
    reward = play(ep, key, env["AGENTRL_GATE_URL"])
    if mode == "print":
        print("some chatter first")
        print(json.dumps({"reward": 1.0 + reward, "success": True}))
    elif mode == "report":
        httpx.post(env["AGENTRL_REWARD_URL"], json={"reward": reward},
                   headers={"Authorization": f"Bearer {key}"}).raise_for_status()
    # mode "silent": exits 0 having reported nothing


if __name__ == "__main__":
    main()
