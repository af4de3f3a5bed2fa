"""Host memory of the DeepSpeed engine on two CPU ranks (gloo, real processes): the HF export is streamed one
parameter at a time into safetensors shards, so rank 0 never holds the whole model."""
import json
import os

import pytest

from tests.conftest import CORPUS
from tests.test_multirank import ROOT, launch


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    from agentrl.model_zoo import build_tiny

    out = tmp_path_factory.mktemp("wide")  # ~35M parameters: 133 MB in fp32, well above the measuring noise
    build_tiny(out, corpus=CORPUS, vocab_size=512, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
               num_attention_heads=8, num_key_value_heads=8)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_export_streams_shards_and_rank_0_never_holds_the_model(wide_model_dir, tmp_path, monkeypatch):
    import torch

    # glibc hands every block over 128 KiB back to the system when freed (by default the threshold rises with
    # the blocks freed, and the heap then keeps them): resident memory then reads what is live
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    from agentrl.learner.models import load_model

    export = tmp_path / "export"
    proc = launch(2, [str(wide_model_dir), str(tmp_path), str(export), "16"],
                  script=str(ROOT / "tests" / "load_rss_worker.py"), timeout=500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # rank 0: a 16 MB shard, its serialized bytes and one gathered parameter; 273 MB (2x the model) when the
    # whole model was gathered and cloned; rank 1: one parameter (135 MB before: it gathered everything too)
    assert r0["export_peak_mb"] < 0.4 * r0["model_fp32_mb"], (r0, r1)
    assert r1["export_peak_mb"] < 0.2 * r1["model_fp32_mb"], (r0, r1)
    index = json.loads((export / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 8
    assert not list(export.glob("*.tmp"))
    got, want = load_model(export).state_dict(), load_model(wide_model_dir).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert os.path.isfile(export / "tokenizer_config.json") and os.path.isfile(export / "config.json")
