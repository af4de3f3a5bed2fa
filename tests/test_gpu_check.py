"""scripts/gpu_check.sh: its dry run checks on CPU what the GPU check needs and prints the commands it runs."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"


def gpu_check(*args, cwd=None):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dry_run_passes_on_cpu_and_prints_the_planned_commands(tmp_path):
    r = gpu_check("--dry-run", "--out", str(tmp_path / "check"))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "FAIL" not in out and "dry run passed" in out
    # planned for a GPU node: --print-config checks this machine (no GPU), the launch plan the layout
    assert "ok    config of the grpo run: planned for a GPU node" in out
    assert "ok    config of the deepspeed run: planned for a GPU node" in out
    planned = out.split("== planned commands", 1)[1].splitlines()
    train = [c for c in planned if "agentrl.cli train grpo" in c]
    assert len(train) == 3 and all("trainer.device=cuda" in c and "model.autocast=bf16" in c for c in train)
    # on two GPUs: one vLLM server on GPU 1, weights synced over NCCL
    assert all(k in train[2] for k in ("trainer.generator=vllm", "trainer.vllm_sync=nccl", "trainer.vllm_gpus="))
    assert "ok    config of the vllm run (two GPUs):" in out
    # the 7B-wide slice on one ZeRO-3 rank at 2k/4k/8k tokens, without and with checkpointing, and the plan's
    # estimate for it (no GPU needed)
    sliced = [c for c in planned if "scripts/learner_memory.py" in c]
    assert len(sliced) == 2 and "--checkpointing" in sliced[1] and all("hidden_size=3584" in c for c in sliced)
    assert "2048\\,4096\\,8192" in sliced[0]
    assert "ok    the launch plan's estimate for the 7B-wide slice at 8192 tokens: 8192 tokens" in out
    assert "trainer.steps=3" in train[0] and "--model tiny:" in train[0] and "--env sokoban" in train[0]
    assert "smollm2" not in out  # no model package, nothing downloaded
    assert "ok    the tiny model: tiny:" in out
    assert "torch.distributed.run" in train[1] and "trainer.deepspeed_config=configs/deepspeed/zero3.json" in train[1]
    bench = [c for c in planned if "bench learner" in c]
    assert len(bench) == 2 and "--compile" in bench[1] and all("--device cuda" in c for c in bench)
    assert not (tmp_path / "check").exists()  # a dry run writes nothing


def test_without_a_project_environment_it_names_the_fix(tmp_path):
    # a copy of the script outside any checkout with a .venv: no system python3 is taken instead
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "gpu_check.sh"
    script.write_text(SCRIPT.read_text())
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    r = subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and r.stderr.startswith("error: no project environment (.venv-gpu or .venv in ")


def test_unknown_argument_is_one_error_line():
    r = gpu_check("--dryrun")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["error: unknown argument '--dryrun' (see --help)"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_check_without_a_gpu_is_one_error_line_before_any_work(tmp_path):
    r = gpu_check("--out", str(tmp_path / "check"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: torch sees no CUDA device")
    assert not (tmp_path / "check").exists()
