"""DeepSpeed's precision is the DeepSpeed config's: under configs/deepspeed/zero3.json (bf16 enabled) the
policy's, the critic's and the reference's ZeRO-3 partitions are bf16 whatever model.dtype says (DeepSpeed
casts a model handed to it whole, never one built under zero.Init), the optimizer keeps fp32 master weights
and Adam moments, log-probs and values come out in fp32, and an fp32 export is the master weights."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.learner.deepspeed_engine import load_ds_config, weights_dtype

ROOT = Path(__file__).resolve().parent.parent


def test_the_shards_dtype_is_the_deepspeed_configs():
    bf16 = load_ds_config(ROOT / "configs/deepspeed/zero3.json")
    assert weights_dtype(bf16, "float32") == "bfloat16" and weights_dtype(bf16, "bfloat16") == "bfloat16"
    fp32 = load_ds_config(None)  # the engine's default: ZeRO-3 without bf16
    assert weights_dtype(fp32, "float32") == "float32" and weights_dtype(fp32, "bfloat16") == "bfloat16"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_under_zero3_json_holds_bf16_partitions(tiny_model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "ds_bf16_worker.py"), str(tiny_model_dir),
                          str(tmp_path)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads((tmp_path / "report.json").read_text())
    assert r["policy"] == r["critic"] == r["reference"] == ["torch.bfloat16"] and r["partitioned"]
    assert r["bf16_enabled"] and r["master"] == ["torch.float32"] and r["adam"] == ["torch.float32"]
    assert r["logp"] == r["values"] == r["ref"] == "torch.float32" and r["finite"]

    import torch
    from safetensors.torch import load_file

    held = load_file(str(tmp_path / "as_held" / "model.safetensors"))
    assert {t.dtype for t in held.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "as_held" / "config.json").read_text())["dtype"] == "bfloat16"
    fp32 = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    assert {t.dtype for t in fp32.values()} == {torch.float32}
    (name, master), = torch.load(tmp_path / "master.pt").items()
    assert torch.equal(fp32[name], master) and not torch.equal(master, master.bfloat16().float())
