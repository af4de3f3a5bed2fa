"""A checkpoint's HF folder (step-N/model) is written in ``model.export_dtype``: bfloat16 under DeepSpeed by
default (tests/test_deepspeed.py checks the ZeRO-3 export), the learner's dtype under the torch engine."""
import json

import torch
from safetensors import safe_open

from agentrl.checkpoint import checkpoint_bytes, engine_checkpoint_bytes, export_dtype
from agentrl.config import ModelCfg
from agentrl.learner.engine import EngineConfig, TorchEngine
from agentrl.learner.models import load_model


def _dtypes(folder):
    out = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            out |= {fh.get_slice(k).get_dtype() for k in fh.keys()}
    return out


def test_auto_is_bfloat16_under_deepspeed_and_the_learners_dtype_under_torch():
    assert ModelCfg().export_dtype == "auto"
    assert export_dtype("deepspeed", EngineConfig()) == "bfloat16"
    assert export_dtype("torch", EngineConfig()) == "float32"
    assert export_dtype("torch", EngineConfig(dtype="bfloat16")) == "bfloat16"
    assert export_dtype("deepspeed", EngineConfig(export_dtype="float32")) == "float32"
    # a 7B ZeRO-3 checkpoint: 16 bytes a parameter of shards plus a 2-byte export (4 in fp32)
    p = 7_000_000_000
    assert checkpoint_bytes(p, "deepspeed", "float32", "float32") - checkpoint_bytes(p, "deepspeed", "float32",
                                                                                     "bfloat16") == 2 * p


def test_a_torch_checkpoint_exports_in_the_chosen_dtype_and_stays_exact_by_default(tiny_model_dir, tmp_path):
    eng = TorchEngine(tiny_model_dir, EngineConfig())
    eng.save(tmp_path / "fp32")
    assert _dtypes(tmp_path / "fp32" / "model") == {"F32"}
    want = eng.model.state_dict()
    got = load_model(tmp_path / "fp32" / "model").state_dict()
    assert all(torch.equal(got[k], want[k]) for k in got)

    eng.cfg.export_dtype = "bfloat16"
    eng.save(tmp_path / "bf16")
    assert _dtypes(tmp_path / "bf16" / "model") == {"BF16"}
    assert json.loads((tmp_path / "bf16" / "model" / "config.json").read_text())["dtype"] == "bfloat16"
    got = load_model(tmp_path / "bf16" / "model", "bfloat16").state_dict()
    assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in got)
    # the free-space check counts the export at 2 bytes a parameter
    assert (engine_checkpoint_bytes(tiny_model_dir, "torch", EngineConfig())
            - engine_checkpoint_bytes(tiny_model_dir, "torch", EngineConfig(export_dtype="bfloat16"))) > 0
    assert eng.model.dtype == torch.float32  # the engine's own weights untouched
