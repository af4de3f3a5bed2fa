"""Scripts beside the CLI: scripts/eval_loops.py, and the GPU study's driver
scripts/studies/gpu_from_one_warm_start.sh."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_SCRIPT = ROOT / "scripts" / "studies" / "gpu_from_one_warm_start.sh"


def _script(name: str):
    """scripts/NAME.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FAKE_TRAIN = """#!/usr/bin/env bash
# stands in for `python -m agentrl.cli train ...`; any other use runs the real Python
[[ "$1" != "-m" ]] && exec {py} "$@"
args=" $* "
while [[ $# -gt 0 ]]; do case "$1" in --out) out=$2; shift;; esac; shift; done
mkdir -p "$out"
echo "$args" > "$out/args.txt"
if [[ "$out" == */ws ]]; then mkdir -p "$out/warm_start"; echo {{}} > "$out/warm_start/config.json"; exit 0; fi
row0='{{"step": 0, "eval/success": 0.25, "eval/success/Pick": 0.5, "eval/pass@1": 0.25, "eval/pass@4": 0.5}}'
[[ "$args" == *" eval.at_start=false "* ]] && row0='{{"step": 0}}'  # another run reads the warm start
echo "$row0" > "$out/metrics.jsonl"
echo '{{"step": 1, "env_steps": 7}}' >> "$out/metrics.jsonl"
printf '{{"step": 2, "env_st' >> "$out/metrics.jsonl"  # a row torn by the stop
sleep ${{FAKE_SLEEP:-300}}
"""


def test_gpu_script_stopped_early_stops_its_runs_and_still_summarises(tmp_path):
    """The script ends everything it started: when `timeout` stops the script, the runs stop
    with it and OUT/summary.jsonl still holds what they logged, a torn last row skipped (the training CLI
    faked by a shell script)."""
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_TRAIN.format(py=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "out"
    proc = subprocess.Popen(["bash", str(GPU_SCRIPT), str(out), "crps:0 grpo:1"],
                            env={**os.environ, "PY": str(fake)}, stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not all((out / r / "metrics.jsonl").exists() for r in ("crps-s0", "grpo-s1")) and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 124
    lines = [json.loads(x) for x in (out / "summary.jsonl").read_text().splitlines()]
    rows = {r["run"]: r for r in lines}
    # the first run read the shared warm start, the second skipped it (eval.at_start=false)
    assert lines[0] == {"run": "warm_start", "eval_success": 0.25, "by_type": {"Pick": 0.5}, "read_by": "crps-s0"}
    assert rows["crps-s0"] == {"run": "crps-s0", "eval_success": {"0": 0.25}, "env_steps": 7,
                               "eval_pass": {"0": {"pass@4": 0.5}}}
    assert rows["grpo-s1"] == {"run": "grpo-s1", "eval_success": {}, "env_steps": 7}
    assert len(lines) == 3 and stdout.count("\n") == 3
    time.sleep(0.5)
    alive = subprocess.run(["pgrep", "-f", f"--out {out}/"], capture_output=True, text=True).stdout.split()
    assert not alive, "the runs outlived the script"


def test_gpu_script_reads_the_warm_start_after_the_runs_with_read_ws_after(tmp_path):
    """READ_WS=after: no run spends its time on the warm start's reading; a run of no steps from the
    warm start reads it once they have ended, and the summary's first line is that reading."""
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_TRAIN.format(py=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "out"
    got = subprocess.run(["bash", str(GPU_SCRIPT), str(out), "crps:0 crps:1",
                          "trainer.steps=12"], env={**os.environ, "PY": str(fake), "FAKE_SLEEP": "0",
                                                    "READ_WS": "after", "RL_ARGS": "model.lora_r=16 optim.lr=2e-4"},
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    lines = [json.loads(x) for x in (out / "summary.jsonl").read_text().splitlines()]
    assert lines[0] == {"run": "warm_start", "eval_success": 0.25, "by_type": {"Pick": 0.5}, "read_by": "ws-read"}
    assert [r["run"] for r in lines[1:]] == ["crps-s0", "crps-s1"]
    assert all(" eval.at_start=false " in (out / r / "args.txt").read_text() for r in ("crps-s0", "crps-s1"))
    read = (out / "ws-read" / "args.txt").read_text()
    assert " sft.warm_start={out}/ws/warm_start trainer.steps=12 model.lora_r=16 optim.lr=2e-4 trainer.steps=0 " \
        "eval.at_start=true ".format(out=out) in read
    # RL_ARGS reach the runs and the reading, not the warm start's SFT
    assert all(" model.lora_r=16 optim.lr=2e-4 " in (out / r / "args.txt").read_text() for r in ("crps-s0", "crps-s1"))
    assert "lora" not in (out / "ws" / "args.txt").read_text()


def test_eval_loops_counts_repeats_revisits_and_verbs():
    """scripts/eval_loops.py on hand-made rows: a won episode, a failed one that loops on its last action,
    and an old row without actions (skipped)."""
    el = _script("eval_loops")
    rows = [dict(won=True, actions=["go to desk 1", "take pen 1 from desk 1"], ineffective=[]),
            dict(won=False, actions=["go to desk 1", "open drawer 1", "open drawer 1", "open drawer 1"],
                 ineffective=[2, 3]),
            dict(won=False, turns=30)]
    s = el.loop_stats(rows)
    assert s["episodes"] == 2 and s["success"] == 0.5
    assert s["ineffective"] == pytest.approx(2 / 6) and s["ineffective_repeating_last"] == 1.0
    assert s["failed_turns_seen_before"] == pytest.approx(2 / 4) and s["failed_distinct_actions"] == 2
    assert s["failed_verbs"] == {"open": 0.75, "go to": 0.25}
