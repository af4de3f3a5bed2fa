"""The learner's memory stays bounded when every batch has a new shape (bf16 autocast on CPU)."""
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, os, random, sys
import torch
import torch.nn.functional as F
from agentrl.learner.models import cap_kernel_caches

cap_kernel_caches()  # what loading a model does first: after `import torch`, before the first matmul

print(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], os.environ["LRU_CACHE_CAPACITY"])
libc = ctypes.CDLL("libc.so.6")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
rng, w, before = random.Random(0), torch.randn(512, 192, requires_grad=True), 0.0
for i in range(300):
    x = torch.randn(rng.randint(2000, 16000), 192, requires_grad=True)  # a new micro-batch shape
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.linear(x, w)
    y.float().sum().backward()
    libc.malloc_trim(0)  # what is left is held, not freed-but-kept by the allocator
    if i == 49:
        before = rss()
print(rss() - before)
"""


def probe(code: str = PROBE, **env_over):
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, **env_over}, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split("\n")
    return out[0], float(out[1]) if out[1] else None


def test_loading_a_model_caps_onednn_kernel_caches_unless_the_user_set_them():
    assert probe(PROBE.split("libc =")[0])[0] == "64 64"
    caps, _ = probe(PROBE.split("libc =")[0], ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024")
    assert caps == "1024 64"  # a user's own setting wins


def _native_bf16() -> bool:
    import torch

    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


# The growth this guards was measured with oneDNN's native bf16 kernels (AVX512-BF16); on a CPU without
# them (an AVX2 EPYC) the 300 bf16 matmuls did not finish within the probe's 300 s.
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and glibc's malloc_trim")
@pytest.mark.skipif(not _native_bf16(), reason="no native bf16 kernels on this CPU: the probe runs past its time limit")
def test_bf16_matmuls_of_new_shapes_do_not_grow_memory():
    caps, growth = probe()
    assert caps == "64 64"
    assert growth < 100, f"{growth:.0f} MB held after 250 new shapes"  # uncapped: ~1.7 MB a shape (~420 MB)


def test_bench_learner_reports_time_and_memory(tiny_model_dir, tmp_path):
    """`agentrl bench learner` runs on a model folder and writes its figures (the memory drift it reports
    is a benchmark's job, not a test's: readings move by tens of MB a step)."""
    import json
    import os

    from agentrl.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "learner", "--model", str(tiny_model_dir), "--learner-steps", "3", "--lengths", "20-60",
                 "--json", str(out)]) == 0
    fig = json.loads(out.read_text())
    assert fig["steps"] == 3 and len(fig["rss_mb"]) == 3 and fig["step_s"] > 0
    # 4 layers: each dispatches its projections, attention and MLP forward and backward
    assert 500 < fig["top_level_ops_per_step"] < fig["aten_ops_per_step"]
    assert 0 < fig["top_level_ops_update"] < fig["top_level_ops_per_step"]
    assert main(["bench", "learner", "--model", str(tiny_model_dir), "--learner-steps", "1", "--lengths", "20-60",
                 "--rows", "4", "--lora", "4", "--json", str(out)]) == 0
    lora = json.loads(out.read_text())
    assert lora["lora"] == 4 and lora["rows"] == 4 and lora["top_level_ops_per_step"] > 500
    assert fig["onednn_cache"] == os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
