"""agentrl: multi-turn reinforcement learning for LLM agents."""
import os as _os

__version__ = "0.1.0"

# Under bf16 autocast on CPU, oneDNN and ideep each keep a compiled kernel per matmul shape (up to 1024
# each). Training batches rarely repeat a shape, so the caches only grew (an ALFWorld run's learner reached
# 10 GiB); 64 bounds them at the same speed (docs/memory.md). Read at the first matmul: set before it.
for _k in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    _os.environ.setdefault(_k, "64")
