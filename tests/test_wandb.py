"""trainer.wandb=true writes an offline wandb run in the run folder: the step metrics and the resolved config."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


def records(run_dir: Path) -> list[dict]:
    """The run's .wandb log as wandb itself reads it (`wandb leet inspect --json`, one record a line)."""
    wandb_cli = Path(sys.executable).parent / "wandb"
    r = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", str(run_dir)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wandb_true_writes_an_offline_run_with_the_step_metrics_and_the_config(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    # offline as a user gets it; a base URL nothing listens on makes any attempt to reach a server fail loudly
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(out), "WANDB_BASE_URL": "http://127.0.0.1:9",
           "WANDB_API_KEY": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", "grpo", "--env", "bandit", "--model",
                        str(tiny_model_dir), "--out", str(out), "trainer.steps=2", "trainer.wandb=true",
                        "trainer.tensorboard=false", "trainer.progress=false", "trainer.checkpoint_every=100",
                        "rollout.groups=2", "rollout.group_size=2", "eval.tasks=2", "eval.every=1",
                        "sft.enabled=false"], capture_output=True, text=True, timeout=540, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = list((out / "wandb").glob("*run-*"))
    assert [p.name.startswith("offline-run-") for p in runs] == [True], runs  # one run, offline, in the run folder

    recs = records(runs[0])
    history = [x["history"]["item"] for x in recs if x["type"] == "history"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [h["_step"] for h in history] == [row["step"] for row in rows] == [0, 1, 2]
    for h, row in zip(history, rows):  # every number of every step, as metrics.jsonl has it
        assert {k: h[k] for k in row} == pytest.approx(row)
    assert "eval/success" in history[0] and "reward_mean" in history[2]

    config = next(x["run"]["config"]["update"] for x in recs if x["type"] == "run")
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert {k: config[k] for k in resolved} == resolved  # the resolved config, every section
    assert config["trainer"]["wandb"] is True and config["env"] == "bandit"
    exits = [x["exit"] for x in recs if x["type"] == "exit"]
    assert exits and exits[-1].get("exit_code", 0) == 0
