"""Loading a policy model: an HF folder (config, safetensors, tokenizer with a chat template) that
transformers, our generator, the learner engines and ``vllm serve`` all load the same way. Which folder a
model spec (``tiny``, ``smollm2``, a path) names, and building the first two, is ``agentrl.model_zoo``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any


CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ModelError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------------------
# loading


def load_tokenizer(folder: str | Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if not tok.chat_template:
        tok.chat_template = CHATML
    return tok


def save_config(model: Any, folder: str | Path, dtype: str | None = None) -> None:
    """``model``'s config (and generation config) into ``folder``, stating ``dtype`` when the weights beside
    it were written in another dtype than the model holds, so loaders pick the file's."""
    import copy

    import torch

    config = model.config
    if dtype is not None:
        config = copy.deepcopy(config)
        config.dtype = getattr(torch, dtype)
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


KERNEL_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def cap_kernel_caches(capacity: int = 64) -> None:
    """Cap oneDNN's and ideep's per-shape kernel caches unless the user set them. Under bf16 autocast on CPU
    each keeps a compiled kernel per matmul shape (up to 1024); training batches rarely repeat a shape, so
    the caches only grew (an ALFWorld run's learner reached 10 GiB); 64 bounds them at the same speed
    (docs/guides/memory.md). Both are read at the first matmul, not at ``import torch``: every model is
    built by ``load_model``, which calls this first, and so do the trainer and the CLI."""
    for key in KERNEL_CACHES:
        os.environ.setdefault(key, str(capacity))


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX512-BF16 and AMX; aarch64's BF16 extension


def native_bf16(device: str, cpuinfo: str | None = None) -> bool:
    """Whether bf16 autocast runs at speed on ``device``: CUDA devices, and CPUs with bf16 instructions (a flag
    of ``BF16_CPU_FLAGS`` in /proc/cpuinfo). Elsewhere oneDNN emulates bf16: measured 6-7x slower than fp32
    for the tiny model's forward and backward on an AVX2-only CPU."""
    if not device.startswith("cpu"):
        return True
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = {w for line in cpuinfo.splitlines() if line.split(":")[0].strip() in ("flags", "Features")
             for w in line.split(":", 1)[1].split()}
    return any(f in flags for f in BF16_CPU_FLAGS)


def load_model(folder: str | Path, dtype: str = "float32", device: str = "cpu") -> Any:
    cap_kernel_caches()  # before the model's first matmul
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype))
    return model.to(device)


def enable_checkpointing(model: Any) -> None:
    """Activation checkpointing on ``model``'s decoder layers, non-reentrant (HF's own: it also makes the
    embeddings' output require grad, which a frozen base under LoRA needs for gradients to reach the adapters).
    The backward pass recomputes each layer's forward instead of keeping its activations."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name; the old one warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def stop_token_ids(tokenizer: Any, model_config: Any = None) -> list[int]:
    """Token ids that end a turn: the tokenizer's eos and the chat template's end-of-message token."""
    ids = {tokenizer.eos_token_id}
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end, int) and end != tokenizer.unk_token_id:
        ids.add(end)
    eos = getattr(model_config, "eos_token_id", None) if model_config is not None else None
    for e in (eos if isinstance(eos, list) else [eos]):
        if e is not None:
            ids.add(e)
    return sorted(i for i in ids if i is not None)
