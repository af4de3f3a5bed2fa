"""`--env agent:external`: the trainer serves the endpoint, harnesses started elsewhere claim the episodes and
report their rewards over the gate's HTTP contract (agentrl.rollout.harness_gate), with the run's key."""
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from agentrl.envs.agent_program import KEY_ENV
from agentrl.envs.base import EnvError
from agentrl.envs.pool import InProcessEnvs
from agentrl.envs.registry import make
from agentrl.learner.models import load_tokenizer
from agentrl.rollout import agent_program
from agentrl.rollout.engine import RolloutConfig, RolloutEngine, Start
from agentrl.types import Completion, SamplingParams

TASKS = "tests.agent_programs:tasks"
KEY = "k" * 8 + uuid.uuid4().hex
ROOT = Path(__file__).resolve().parent.parent


class Scripted:
    """Answers every prompt with the same text, as token ids."""

    def __init__(self, tok, text):
        self.tok, self.tokenizer, self.text, self.stop_ids = tok, tok, text, ()

    def generate(self, prompts, sampling, seeds=None, choices=None):
        ids = self.tok(self.text, add_special_tokens=False)["input_ids"]
        return [Completion(ids, [-0.5] * len(ids), self.text, "stop") for _ in prompts]


def _gate_of(envs, timeout=60):
    deadline = time.monotonic() + timeout
    while (gate := getattr(agent_program._held.get(envs), "gate", None)) is None:
        assert time.monotonic() < deadline, "the gate did not start"
        time.sleep(0.05)
    return gate


def test_harnesses_claim_episodes_chat_and_report_rewards_and_need_the_key(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    tok = load_tokenizer(tiny_model_dir)
    envs = InProcessEnvs("agent:external", 2, {"tasks": TASKS, "timeout_s": 4, "failure_reward": -1.0})
    cfg = RolloutConfig(max_turns=3, sampling=SamplingParams(max_new_tokens=24))
    engine = RolloutEngine(Scripted(tok, "Paris."), tok, envs, "agent:external", cfg)
    out = {}
    rollout = threading.Thread(target=lambda: out.update(eps=engine.run([Start("train/00000", 0, "g0"),
                                                                         Start("train/00001", 0, "g1")])))
    rollout.start()
    gate = _gate_of(envs)
    url = gate.url
    while len(gate.offers) < 2:
        time.sleep(0.05)
    service = gate.offers[0].lane.service
    assert service.sched.live == 0  # offered, not claimed: the scheduler waits for no request of theirs
    assert url.startswith("http://127.0.0.1:")  # loopback unless another host is asked for
    h = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{url}/episodes").status_code == 401
    assert httpx.post(f"{url}/episodes", headers={"Authorization": "Bearer wrong"}).status_code == 401
    bad_wait = httpx.post(f"{url}/episodes", headers=h, params={"wait_s": "nan"})
    assert bad_wait.status_code == 400 and bad_wait.json()["error"]["param"] == "wait_s"
    a = httpx.post(f"{url}/episodes", headers=h).json()
    b = httpx.post(f"{url}/episodes", headers=h).json()
    assert a["task_id"] == "train/00000" and a["task"]["question"] == "Push box 0." and a["timeout_s"] == 4
    assert b["task_id"] == "train/00001" and a["base_url"] == f"{url}/ep/{a['episode_id']}/v1"
    assert service.sched.live == 2
    client = openai.OpenAI(base_url=a["base_url"], api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(model=a["model"], messages=[{"role": "user", "content": "Capital?"}])
    assert reply.choices[0].message.content == "Paris."
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=a["base_url"], api_key="wrong", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}])
    bad = httpx.post(f"{url}/episodes/{a['episode_id']}/reward", headers=h, json={"reward": "high"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reward"
    ok = httpx.post(f"{url}/episodes/{a['episode_id']}/reward", headers=h, json={"reward": 1.0, "success": True})
    assert ok.status_code == 200
    again = httpx.post(f"{url}/episodes/{a['episode_id']}/reward", headers=h, json={"reward": 1.0})
    assert again.status_code == 404  # an episode ends once
    rollout.join(60)  # b is never reported: it times out 4 s after its claim
    first, second = out["eps"]
    assert first.error == "" and first.won and first.score == 1.0 and len(first.turns) == 1
    assert second.error.startswith("TimeoutError: the harness reported no reward") and second.score == -1.0
    late = httpx.post(f"{url}/episodes/{b['episode_id']}/reward", headers=h, json={"reward": 1.0})
    assert late.status_code == 404
    # between rollouts: nothing to claim, no episode to chat in
    assert httpx.post(f"{url}/episodes", headers=h, params={"wait_s": 0}).status_code == 204
    assert httpx.post(f"{a['base_url']}/chat/completions", headers=h, json={"messages": []}).status_code == 404
    envs.close()  # the run's envs close: so does the gate
    with pytest.raises(httpx.TransportError):
        httpx.post(f"{url}/episodes", headers=h, params={"wait_s": 0})


def test_agent_external_options_are_one_line_naming_the_key(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(EnvError, match=f"needs \\${KEY_ENV}"):
        make("agent:external", tasks=TASKS)
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(EnvError, match="at least 16 characters"):
        make("agent:external", tasks=TASKS)
    monkeypatch.setenv(KEY_ENV, KEY)
    with pytest.raises(EnvError, match="env_kwargs.port must be 0 \\(a free port\\) to 65535, got 70000"):
        make("agent:external", tasks=TASKS, port=70000)
    with pytest.raises(EnvError, match="env_kwargs.host is an option of agent:external only"):
        make("agent:tests.agent_programs:chatty", tasks=TASKS, host="0.0.0.0")
    assert make("agent:external", tasks=TASKS, host="0.0.0.0", port=8123).spec.host == "0.0.0.0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_with_harness(tmp_path, model, harness_cmd, host="127.0.0.1", command=None):
    """2 GRPO steps of agent:external with the tiny model, the episodes played by ``harness_cmd(url)`` (or, with
    ``command``, by that command started per episode: no harness then, ``("", 0)`` for what it said)."""
    from agentrl import Trainer
    from agentrl.config_loader import load_config

    port = _free_port()
    cfg = load_config("grpo", env="agent:external", overrides=[
        f"model.name={model}", f"trainer.out_dir={tmp_path / 'run'}", "trainer.steps=2",
        "trainer.tensorboard=false", "trainer.progress=false", "rollout.groups=2", "rollout.group_size=4",
        "rollout.slots=4", "rollout.max_turns=3", "rollout.max_new_tokens=24", "eval.tasks=2", "eval.every=2",
        f"env_kwargs.tasks={TASKS}", f"env_kwargs.host={host}", f"env_kwargs.port={port}"])
    if command:
        cfg.env_kwargs["command"] = command
    env = {**os.environ, KEY_ENV: os.environ[KEY_ENV], "PYTHONPATH": str(ROOT)}
    t = Trainer.from_config(cfg)
    harness = subprocess.Popen(harness_cmd(port), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, cwd=ROOT) if harness_cmd else None
    said = ""
    try:
        t.train()
    finally:
        t.close()  # the gate closes with the run's envs: the harness sees the run is over
        try:
            said, _ = harness.communicate(timeout=60) if harness else ("", None)
        except subprocess.TimeoutExpired:
            harness.kill()
            said, _ = harness.communicate()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return rows, said, harness.returncode if harness else 0


@pytest.fixture
def keyed(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def _check_rows(rows):
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["agent_failures"] == 0.0 and r["turns_per_episode"] == 2.0 and "loss" in r
    assert any(not r.get("skipped_update") for r in rows[1:])


def _check(rows, said, code):
    assert code == 0, said
    assert "keyless: 401" in said and "netns: net:[" in said  # a request without the run's key is refused
    _check_rows(rows)
    assert said.count("episode train/") >= 16 and "done:" in said


@pytest.mark.timeout(400)
def test_a_harness_in_another_process_trains_two_grpo_steps(tmp_path, tiny_model_dir, keyed):
    rows, said, code = _train_with_harness(
        tmp_path, tiny_model_dir, lambda port: [sys.executable, "tests/harness_client.py", f"http://127.0.0.1:{port}"])
    _check(rows, said, code)


NETNS = f"agentrl-h{os.getpid() % 10000}"


def _sh(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


@pytest.fixture
def netns():
    """A network namespace joined to this one by a veth pair: 10.213.0.1 here, 10.213.0.2 there."""
    if not shutil.which("ip") or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 (ip netns)")
    if _sh("ip", "netns", "add", NETNS).returncode != 0:
        pytest.skip("cannot create a network namespace here")
    try:
        host_if, ns_if = f"vh{os.getpid() % 10000}", f"vn{os.getpid() % 10000}"
        steps = [("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if),
                 ("ip", "link", "set", ns_if, "netns", NETNS),
                 ("ip", "addr", "add", "10.213.0.1/30", "dev", host_if), ("ip", "link", "set", host_if, "up"),
                 ("ip", "netns", "exec", NETNS, "ip", "addr", "add", "10.213.0.2/30", "dev", ns_if),
                 ("ip", "netns", "exec", NETNS, "ip", "link", "set", ns_if, "up"),
                 ("ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up")]
        for step in steps:
            if (r := _sh(*step)).returncode != 0:
                pytest.skip(f"cannot wire the namespace: {' '.join(step)}: {r.stderr.strip()[:200]}")
        yield NETNS
    finally:
        _sh("ip", "link", "del", f"vh{os.getpid() % 10000}")
        _sh("ip", "netns", "del", NETNS)


@pytest.mark.slow  # changes the machine's network setup (a namespace, a veth pair) for the test's ~15 s
@pytest.mark.timeout(400)
def test_a_harness_in_another_network_namespace_trains_two_grpo_steps_with_the_key(tmp_path, tiny_model_dir, keyed,
                                                                                   netns):
    """The gate bound to the veth address (env_kwargs.host): the harness reaches it only over that link; its
    own loopback is its namespace's, where the trainer listens on nothing."""
    rows, said, code = _train_with_harness(
        tmp_path, tiny_model_dir, lambda port: ["ip", "netns", "exec", netns, sys.executable, "tests/harness_client.py",
                                f"http://10.213.0.1:{port}"], host="10.213.0.1")
    _check(rows, said, code)
    assert f"netns: {os.readlink('/proc/self/ns/net')}" not in said  # the harness ran in another namespace
