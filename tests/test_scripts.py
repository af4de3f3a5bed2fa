"""Scripts a user runs beside the CLI: scripts/offline_bundle.py, gpu_from_one_warm_start.sh, gpu_sitting.sh,
sitting_state.py, eval_loops.py."""
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    """scripts/NAME.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_offline_bundle_round_trip_skips_what_the_target_has(tmp_path, monkeypatch):
    """scripts/offline_bundle.py: parts under the size cap rejoin into the packed files; a module the
    target Python already imports is moved aside (its copy wins), one it lacks goes on PYTHONPATH; a
    missing part is a clear error, not a traceback."""
    ob = _script("offline_bundle")
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "games").mkdir(parents=True)
    (tmp_path / "cache" / "games" / "g1.txt").write_text("a game")
    parts = ob.pack(tmp_path / "b", ["more_itertools", "hashids"], ["games"], 20_000)
    assert len(parts) > 1 and all(p.stat().st_size <= 20_000 for p in parts)

    real = importlib.util.find_spec
    monkeypatch.setattr(ob.importlib.util, "find_spec", lambda m: None if m == "hashids" else real(m))
    got = ob.unpack(tmp_path / "b", tmp_path / "d")
    assert (got["kept"], got["skipped"]) == (["hashids"], ["more_itertools"])
    site = tmp_path / "d" / "site"
    assert (site / "hashids.py").read_bytes() == Path(real("hashids").origin).read_bytes()
    assert any(p.name.startswith("hashids-") for p in site.glob("*.dist-info"))
    assert not (site / "more_itertools").exists() and (tmp_path / "d" / "present-on-target" / "more_itertools").is_dir()
    assert (tmp_path / "d" / "cache" / "games" / "g1.txt").read_text() == "a game"
    assert f'PYTHONPATH="{site.resolve()}' in (tmp_path / "d" / "env.sh").read_text()

    parts[0].unlink()
    with pytest.raises(SystemExit, match="do not form one bundle"):
        ob.unpack(tmp_path / "b", tmp_path / "d2")


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
    """A device command ends everything it started: when `timeout` stops the script, the runs stop
    with it and OUT/summary.jsonl still holds what they logged, a torn last row skipped (the training CLI
    faked by a shell script)."""
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_TRAIN.format(py=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "out"
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "gpu_from_one_warm_start.sh"), str(out), "crps:0 grpo:1"],
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
    assert "time_limit_s" not in (out / "crps-s0" / "args.txt").read_text()  # no FINISH_BY: no time budget
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
    got = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_from_one_warm_start.sh"), str(out), "crps:0 crps:1",
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


def test_gpu_sitting_study_outlives_its_start_command_and_is_collected(tmp_path):
    """`gpu_sitting.sh start` returns while the study runs on in its own session (stopped here by its
    LIMIT), and `collect` prints the summary and packs the runs' logs and metrics, not their weights."""
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_TRAIN.format(py=sys.executable))
    fake.chmod(0o755)
    env = {**os.environ, "PY": str(fake), "SITTING": str(tmp_path / "s"), "OUT": str(tmp_path / "out")}
    script = str(ROOT / "scripts" / "gpu_sitting.sh")
    t = time.time()
    start = subprocess.run(["bash", script, "start", "4", "60", "crps:0"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=90)
    assert start.returncode == 0, start.stderr
    assert time.time() - t < 45 and "crps-s0: step 1, held-out 0:0.250" in start.stdout
    assert (tmp_path / "s" / "repo" / "agentrl" / "metrics.py").exists()
    # the runs stop stepping in time for their last reading; with a LIMIT this short, after one step
    assert " trainer.time_limit_s=1 " in (tmp_path / "s" / "r" / "crps-s0" / "args.txt").read_text()
    got = subprocess.run(["bash", script, "collect", "30"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert got.returncode == 0, got.stderr
    first, run = map(json.loads, got.stdout.splitlines()[:2])
    assert (first["run"], first["eval_success"], run["eval_success"]) == ("warm_start", 0.25, {"0": 0.25})
    with tarfile.open(tmp_path / "out" / "results.tgz") as tar:
        names = set(tar.getnames())
    assert {"r/crps-s0/metrics.jsonl", "r/crps-s0.log", "r/summary.jsonl"} <= names
    assert not any("warm_start" in n for n in names)


def test_sitting_state_carries_what_resumes_a_study_and_nothing_it_can_remake(tmp_path):
    """scripts/sitting_state.py: the warm start and each run's current checkpoint (not its merged export,
    its older checkpoints, its copy of the warm start or TensorBoard), as two sets, survive pieces -> parts
    -> unpack;
    the warm start's float32 tensors come back float32 with bf16-rounded values, other tensors exactly; a
    missing part and an oversized state are refused with what to do."""
    import torch
    from safetensors.torch import load_file, save_file

    ss = _script("sitting_state")
    study = tmp_path / "r"
    w = torch.randn(64, 32)
    save_file({"w": w, "ids": torch.arange(5)}, str(tmp_path / "ws.safetensors"))
    files = {"summary.jsonl": "{}\n", "crps-s0.log": "log", "ws/config.yaml": "a: 1", "ws/warm_start/config.json": "{}",
             "ws/checkpoints/step-000000/engine.pt": "x" * 5000, "crps-s0/config.yaml": "a: 2",
             "crps-s0/metrics.jsonl": "{}\n", "crps-s0/tb/events": "e", "crps-s0/warm_start/config.json": "{}",
             "crps-s0/checkpoints/step-000003/engine.pt": "adapters", "crps-s0/checkpoints/step-000003/trainer.pt": "t",
             "crps-s0/checkpoints/step-000003/model/model.safetensors": "merged" * 1000,
             "crps-s0/checkpoints/step-000002/engine.pt": "stale"}
    for rel, text in files.items():
        (study / rel).parent.mkdir(parents=True, exist_ok=True)
        (study / rel).write_text(text)
    (study / "ws" / "warm_start" / "model.safetensors").write_bytes((tmp_path / "ws.safetensors").read_bytes())
    (study / "ws" / "checkpoint").symlink_to("checkpoints/step-000000")
    (study / "crps-s0" / "checkpoint").symlink_to("checkpoints/step-000003")

    pieces = ss.pack(study, tmp_path / "pieces", piece_bytes=3000)
    assert len(pieces) > 2 and all(p.stat().st_size <= 3000 for p in pieces)
    assert {p.name.split(".")[0] for p in pieces} == {"ws", "runs"}
    (tmp_path / "returned").mkdir()  # what comes back: the pieces and the digests, copied into one folder
    for p in pieces + [tmp_path / "pieces" / "ws.sha256", tmp_path / "pieces" / "runs.sha256"]:
        (tmp_path / "returned" / p.name).write_bytes(p.read_bytes())
    parts = ss.repart(tmp_path / "returned", tmp_path / "carry", part_bytes=7000)
    assert len(parts) < len(pieces)

    got = ss.unpack(tmp_path / "carry", tmp_path / "next")
    assert got["bf16_restored"] == ["ws/warm_start/model.safetensors"]
    kept = {str(p.relative_to(tmp_path / "next")) for p in (tmp_path / "next").rglob("*")
            if p.is_file() and not p.name.startswith("sitting_state.")}
    assert kept == {"summary.jsonl", "crps-s0.log", "ws/config.yaml", "ws/warm_start/config.json",
                    "ws/warm_start/model.safetensors", "crps-s0/config.yaml", "crps-s0/metrics.jsonl",
                    "crps-s0/checkpoints/step-000003/engine.pt", "crps-s0/checkpoints/step-000003/trainer.pt"}
    assert (tmp_path / "next" / "crps-s0" / "checkpoint" / "engine.pt").read_text() == "adapters"
    t = load_file(str(tmp_path / "next" / "ws" / "warm_start" / "model.safetensors"))
    assert t["w"].dtype == torch.float32 and torch.equal(t["w"], w.to(torch.bfloat16).float())
    assert not torch.equal(t["w"], w) and torch.equal(t["ids"], torch.arange(5))

    (tmp_path / "carry" / "ws.part01").unlink()
    with pytest.raises(SystemExit, match="ws parts .* is one missing"):
        ss.unpack(tmp_path / "carry", tmp_path / "again")
    with pytest.raises(SystemExit, match=r"runs set .* over --max-mib 0 .*step-000003/engine.pt.*model.lora_r"):
        ss.pack(study, tmp_path / "big", sets=("runs",), max_bytes=0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lora_run_carried_as_its_learner_state_resumes_exactly(tiny_model_dir, tmp_path):
    """A study packed, deleted and unpacked at the same path (another sitting) resumes its LoRA run from
    the carried adapters, optimizer and trainer state, and its next step is the uninterrupted run's: the
    reading a run takes at its last step leaves its random stream where the longer run has it."""
    from tests.test_trainer import run, small

    from agentrl.config import load_config

    ss = _script("sitting_state")
    study = tmp_path / "r"
    run(load_config("grpo", env="sokoban", overrides=small(study / "ws", tiny_model_dir, "trainer.steps=0",
                                                           "eval.tasks=0")))
    # no group filter and an entropy bonus: the untrained tiny model's all-fail groups still give a gradient
    rl = ["model.lora_r=4", f"sft.warm_start={study}/ws/warm_start", "eval.every=100", "algo.filters=[dropped]",
          "algo.entropy_coef=0.01"]
    run(load_config("grpo", env="sokoban", overrides=small(study / "grpo-s0", tiny_model_dir, *rl, "trainer.steps=1")))
    run(load_config("grpo", env="sokoban", overrides=small(tmp_path / "whole", tiny_model_dir, *rl)))
    ss.pack(study, tmp_path / "pieces", keep_dtype=True)
    shutil.rmtree(study)
    ss.unpack(tmp_path / "pieces", study)
    assert not (study / "grpo-s0" / "warm_start").exists() and not (study / "grpo-s0" / "checkpoint" / "model").exists()
    trainer, _ = run(load_config("grpo", env="sokoban", overrides=small(study / "grpo-s0", tiny_model_dir, *rl)))
    rows = [json.loads(x) for x in (study / "grpo-s0" / "metrics.jsonl").read_text().splitlines()]
    whole = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and trainer.step == 2
    keys = ("loss", "grad_norm", "success", "reward_mean", "env_steps")
    assert {k: rows[2].get(k) for k in keys} == {k: whole[2].get(k) for k in keys}
    assert rows[2]["grad_norm"] > 0


def test_gpu_sitting_ships_a_study_whose_next_sitting_starts_from_it(tmp_path):
    """`ship` returns the study's state in $OUT (digests and pieces of at most 16 MiB); carried back as
    carry/*, the next sitting's `start` unpacks it at the same path before the study, which then finds its
    warm start made and leaves it alone, and that sitting's `ship` returns the runs only."""
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_TRAIN.format(py=sys.executable))
    fake.chmod(0o755)
    sitting, out = tmp_path / "s", tmp_path / "out"
    env = {**os.environ, "PY": str(fake), "SITTING": str(sitting), "OUT": str(out), "FAKE_SLEEP": "0"}
    script = str(ROOT / "scripts" / "gpu_sitting.sh")

    def sh(*args):
        got = subprocess.run(["bash", script, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
        assert got.returncode == 0, got.stderr
        return got.stdout

    sh("start", "20", "60", "crps:0")
    sh("collect", "30")
    (sitting / "r" / "ws" / "args.txt").write_text("made in the first sitting")
    shipped = sh("ship")
    assert "2 pieces" in shipped and "nothing more to give" in shipped
    state = ["runs.part00", "runs.sha256", "ws.part00", "ws.sha256"]
    assert sorted(p.name for p in out.iterdir()) == sorted(["results.tgz", "study.log", *state])
    (tmp_path / "carry").mkdir()
    for name in state:
        (tmp_path / "carry" / name).write_bytes((out / name).read_bytes())
    shutil.rmtree(out)
    shutil.rmtree(sitting)  # a fresh machine; the study comes back at the same path

    started = sh("start", "20", "60", "crps:0")
    assert '"study": "' + str(sitting / "r") + '"' in started
    # the warm start came back and was not made again (the fake training CLI rewrites args.txt)
    assert (sitting / "r" / "ws" / "warm_start" / "config.json").exists()
    assert (sitting / "r" / "ws" / "args.txt").read_text() == "made in the first sitting"
    assert (sitting / "r" / "crps-s0" / "args.txt").exists()
    sh("collect", "30")
    assert "1 pieces" in sh("ship")
    assert sorted(p.name for p in out.iterdir()) == ["results.tgz", "runs.part00", "runs.sha256", "study.log"]


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
