"""Rollout records (agentrl.runs): the file format, torn and resumed files, the reader, `agentrl show`, the
viewer's API and its bind rules; a real run's records, and one killed with SIGKILL mid-run."""
import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import agentrl.runs
from agentrl.runs.records import RolloutRecorder, members, records_path
from agentrl.types import Episode, Turn


def _episode(group, won, actions, adv=0.5):
    turns = [Turn([1, 2, 3], [4, 5], [-0.1, -2.0], f"<answer>{a}</answer>", [a], True, f"obs after {a}", 0.0, False,
                  info={"advantage": adv}) for a in actions]
    e = Episode("sokoban", "train/00001", 3, group, turns=turns, won=won, initial_observation="start")
    if not won:
        e.notes["filtered"] = "zero_variance"
    return e


def _write(run, steps, groups=8):
    rec = RolloutRecorder(run, None, groups=groups, tokens=False)
    for s in steps:
        rec.add([_episode(f"{s}:a", True, ["Up", "Left"]), _episode(f"{s}:a", False, ["Down"]),
                 _episode(f"{s}:b", False, ["Right"])], "train", lambda e: float(e.won))
        rec.write(s)
    return rec


def test_records_are_gzip_members_one_per_step_read_back_by_the_api(tmp_path):
    _write(tmp_path, [1, 2, 3])
    data = records_path(tmp_path, "train").read_bytes()
    assert len(list(members(data))) == 3
    assert gzip.decompress(data).count(b'"schema": 1') == 3  # plain gzip readers see every step too
    run = agentrl.runs.open(tmp_path)
    assert run.steps() == [1, 2, 3] and run.steps("eval") == []
    s = run.step(2)
    assert (s.groups_total, s.episodes_total, len(s.episodes)) == (2, 3, 3)
    e = s.episodes[0]
    assert [t["actions"] for t in e["turns"]] == [["Up"], ["Left"]] and e["reward"] == 1.0
    assert e["turns"][0]["advantage"] == 0.5 and e["turns"][0]["logprob_min"] == -2.0
    assert s.episodes[1]["filtered"] == "zero_variance" and list(s.groups()) == ["2:a", "2:b"]
    with pytest.raises(KeyError, match="no train records for step 7"):
        run.step(7)


def test_a_sample_of_groups_and_every_nth_step(tmp_path):
    rec = RolloutRecorder(tmp_path, None, groups=1, every=2, tokens=False)
    for s in (1, 2, 3, 4):
        rec.add([_episode(f"{s}:a", True, ["Up"]), _episode(f"{s}:b", True, ["Up"])])
        rec.write(s)
    run = agentrl.runs.open(tmp_path)
    assert run.steps() == [2, 4]
    assert [e["group"] for e in run.step(4).episodes] == ["4:a"] and run.step(4).groups_total == 2
    RolloutRecorder(tmp_path, None, groups=-1).add([_episode("x", True, ["Up"])])  # -1: off, nothing written


def test_a_torn_last_member_leaves_every_complete_step_and_a_resume_cuts_back(tmp_path):
    _write(tmp_path, [1, 2, 3])
    path = records_path(tmp_path, "train")
    whole = path.read_bytes()
    member = gzip.compress(b'{"step": 4, "split": "train"}\n' + b"x" * 5000)
    path.write_bytes(whole + member[: len(member) // 2])  # killed in the middle of step 4's write
    run = agentrl.runs.open(tmp_path)
    assert run.steps() == [1, 2, 3] and run.step(3).episodes
    _write(tmp_path, [3, 4])  # a run resumed from step 2's checkpoint writes step 3 again
    assert path.read_bytes().startswith(whole[: list(members(whole))[1][1]])
    run.refresh()
    assert agentrl.runs.open(tmp_path).steps() == [1, 2, 3, 4] and run.steps() == [1, 2, 3, 4]


def test_show_prints_a_steps_groups_and_a_groups_turns(tmp_path):
    from rich.console import Console

    from agentrl.viewer.terminal import show

    _write(tmp_path, [1])
    run = agentrl.runs.open(tmp_path)
    con = Console(record=True, width=160)
    show(run, 1, None, console=con)
    out = con.export_text()
    assert "1:a" in out and "1:b" in out and "zero_variance" in out
    show(run, 1, "0", console=con)
    out = con.export_text()
    assert "actions: Up" in out and "actions: Left" in out and "adv +0.500" in out
    with pytest.raises(KeyError, match="no recorded group"):
        show(run, 1, "9", console=con)


def test_viewer_api_and_its_key(tmp_path):
    from fastapi.testclient import TestClient

    from agentrl.viewer.app import make_app

    _write(tmp_path, [1, 2])
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "success": 0.5}\n{"step": 2, "success": NaN}\n')
    c = TestClient(make_app([agentrl.runs.open(tmp_path)]))
    assert c.get("/api/runs").json()[0]["steps"] == [1, 2]
    assert c.get("/api/runs/0/metrics").json()[1]["success"] is None  # NaN is not JSON
    assert len(c.get("/api/runs/0/step/2").json()["episodes"]) == 3
    assert c.get("/api/runs/0/step/5").status_code == 404 and c.get("/api/runs/3/steps").status_code == 404
    assert "app.js" in c.get("/").text and c.get("/static/app.js").status_code == 200
    k = TestClient(make_app([agentrl.runs.open(tmp_path)], api_key="s3cret"))
    assert k.get("/health").status_code == 200
    assert k.get("/api/runs").status_code == 401 and k.get("/static/app.js").status_code == 401
    assert k.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    r = k.get("/?key=s3cret", follow_redirects=False)  # a browser: the key once, then a cookie
    assert r.status_code == 303 and k.get("/api/runs").status_code == 200


def test_view_binds_elsewhere_only_with_a_key(tmp_path):
    import argparse

    from agentrl.commands.view import add_parser
    from agentrl.config import ConfigError

    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)

    def run(*argv):
        args = sub.choices[argv[0]].parse_args(argv[1:])
        return args.func(args)

    with pytest.raises(ConfigError, match="--api-key"):
        run("view", str(tmp_path), "--host", "0.0.0.0", "--api-key", "")
    with pytest.raises(ConfigError, match="not a run folder"):
        run("view", str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="no train records"):
        run("show", str(tmp_path))


SMALL = ["trainer.tensorboard=false", "trainer.progress=false", "rollout.groups=2", "rollout.group_size=2",
         "rollout.slots=4", "rollout.max_turns=2", "rollout.max_new_tokens=8", "eval.tasks=2",
         "sft.enabled=false", "trainer.checkpoint_every=1000",
         "algo.filters=[dropped]", "rollout.fill_groups=0", "eval.every=0"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_real_run_records_its_steps_and_a_sigkill_leaves_them_readable(tiny_model_dir, tmp_path):
    from fastapi.testclient import TestClient

    from agentrl.viewer.app import make_app

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "agentrl.cli", "train", "grpo", "--env", "sokoban", "--out", str(run),
           f"model.name={tiny_model_dir}", "trainer.steps=50", *SMALL]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    path = records_path(run, "train")
    deadline = time.monotonic() + 500
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and len(list(members(path.read_bytes()))) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    time.sleep(1.0)  # into the next step
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    whole = [json.loads(t.split(b"\n", 1)[0])["step"] for _, _, t in members(path.read_bytes())]
    got = agentrl.runs.open(run)
    assert got.steps() == whole and len(whole) >= 2 and whole == list(range(1, len(whole) + 1))
    c = TestClient(make_app([got]))
    assert c.get("/api/runs").json()[0]["steps"] == whole
    for s in whole:  # every complete step shows: its groups, episodes with turns, advantages from the batch
        eps = c.get(f"/api/runs/0/step/{s}").json()["episodes"]
        assert len({e["group"] for e in eps}) == 2 and len(eps) == 4
        assert all(t["advantage"] is not None and t["tokens"] for e in eps for t in e["turns"])
        assert all(t["policy_version"] == s - 1 for e in eps for t in e["turns"])
    assert got.steps("eval")[0] == 0  # the evaluation before training


def test_make_help_lists_every_target_and_eval_help_every_flag():
    import argparse
    import re
    from pathlib import Path

    from agentrl.cli import build_parser

    root = Path(__file__).resolve().parent.parent
    phony = re.search(r"^\.PHONY:(.*)$", (root / "Makefile").read_text(), re.M).group(1).split()
    out = subprocess.run(["make", "-s", "-C", str(root), "help"], capture_output=True, text=True, check=True).stdout
    listed = set(re.findall(r"^make ([a-z-]+)", out, re.M))
    assert set(phony) <= listed, set(phony) - listed
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("eval", "view", "show"):
        bare = [a.option_strings or a.dest for a in sub.choices[name]._actions if not a.help]
        assert not bare, f"agentrl {name}: {bare} without help"


def test_wandb_keys_and_the_rollout_table(tmp_path, monkeypatch):
    import wandb

    from agentrl.config_loader import load_config
    from agentrl.metrics import MetricsLogger

    got = {}

    class Run:  # stands in for wandb's run object: what was logged
        def log(self, row, step):
            got.setdefault("logged", []).append((step, row))

        def finish(self):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kw: got.update(init=kw) or Run())
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = load_config("grpo", env="sokoban", overrides=[
        f"trainer.out_dir={tmp_path}", "trainer.wandb=true", "trainer.tensorboard=false", "trainer.wandb_project=p",
        "trainer.wandb_entity=team", "trainer.wandb_mode=disabled"])
    logger = MetricsLogger.of_run(cfg)
    assert {k: got["init"][k] for k in ("project", "entity", "name")} == dict(project="p", entity="team",
                                                                            name=tmp_path.name)
    assert os.environ["WANDB_MODE"] == "disabled"
    rec = RolloutRecorder(tmp_path, None, tokens=False)
    rec.add([_episode("1:a", True, ["Up", "Left"])])
    rec.write(1, logger)
    step, row = got["logged"][-1]
    table = row["rollouts/train"]
    assert step == 1 and table.columns[:4] == ["step", "group", "task_id", "won"]
    assert table.data[0][6] == "Up | Left" and table.data[0][7] == "0.500 0.500"
    monkeypatch.delenv("WANDB_MODE", raising=False)
