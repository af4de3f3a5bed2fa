"""GPU memory of a run, estimated from a model's ``config.json`` alone (no weights read): the learner's
model states, ZeRO-3 working set, activations and logits per rank, and a vLLM server's weights and the
KV-cache tokens its memory share leaves. The formulas and their derivation are docs/guides/gpu.md's
("GPUs per recipe, on paper"); they are estimates (activations +-30%), for choosing a layout.

Dense decoder-only transformers of the Llama/Qwen/Mistral family (q/k/v/o attention with grouped KV heads,
a gated MLP, RMSNorms); a config of another shape gets the same formulas with its sizes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 2 ** 30
ZERO3_PREFETCH = 5 * 10 ** 7  # parameters in DeepSpeed's ZeRO-3 prefetch bucket (its default)


@dataclass(frozen=True)
class ModelShape:
    hidden: int  # h
    intermediate: int  # I, the MLP's width
    layers: int  # L
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # V
    tied: bool  # input and output embeddings one matrix
    qkv_bias: bool  # Qwen2: q, k and v projections carry a bias

    @property
    def d_kv(self) -> int:
        """The width of K (and of V): KV heads x head dim."""
        return self.kv_heads * self.head_dim

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "ModelShape":
        h = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        return cls(hidden=h, intermediate=int(cfg["intermediate_size"]), layers=int(cfg["num_hidden_layers"]),
                   heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or h // heads), vocab=int(cfg["vocab_size"]),
                   tied=bool(cfg.get("tie_word_embeddings", False)),
                   qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")))

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelShape":
        return cls.from_config(json.loads((Path(folder) / "config.json").read_text()))


def param_count(s: ModelShape) -> int:
    """Ψ: per layer q and o (2·h·q_dim), k and v (2·h·d_kv), their biases when present, the gated MLP
    (3hI) and two RMSNorms (2h); plus the embedding Vh (twice when untied) and a final norm h."""
    q_dim = s.heads * s.head_dim
    attn = 2 * s.hidden * q_dim + 2 * s.hidden * s.d_kv + ((q_dim + 2 * s.d_kv) if s.qkv_bias else 0)
    layer = attn + 3 * s.hidden * s.intermediate + 2 * s.hidden
    return s.layers * layer + s.vocab * s.hidden * (1 if s.tied else 2) + s.hidden


def model_states_bytes(psi: int, ranks: int, stage: int, offload: bool = False) -> int:
    """Per rank, mixed precision (bf16 parameters 2 and gradients 2, fp32 master weights and Adam's m and v
    4 + 4 + 4 = 16 bytes a parameter): ZeRO-3 shards all 16Ψ over the ranks, ZeRO-2 the 14Ψ of gradients
    and optimizer states, ZeRO-1 the 12Ψ of optimizer states; stage 0 (and the torch engine: fp32 weights,
    gradients and Adam, 16Ψ too) shards none. Offload moves the sharded states to host memory."""
    n = max(1, ranks)
    if stage >= 3:
        return 0 if offload else 16 * psi // n
    if stage == 2:
        return 2 * psi + (0 if offload else 14 * psi // n)
    if stage == 1:
        return 4 * psi + (0 if offload else 12 * psi // n)
    return 16 * psi


def working_set_bytes(s: ModelShape, stage: int) -> int:
    """ZeRO-3 gathers each module's bf16 parameters before it runs: the largest module (the embedding or
    untied head, Vh) plus the prefetch bucket. Other stages keep every parameter anyway (0)."""
    return 2 * (s.vocab * s.hidden + ZERO3_PREFETCH) if stage >= 3 else 0


def activation_bytes_per_token(s: ModelShape, checkpointing: bool) -> int:
    """Kept for the backward pass, per token, under bf16: a = 16h + 4d_kv + 8I a layer (the RMSNorms' fp32
    inputs and bf16 outputs, q, k, v, the attention output, the MLP's gate, up, SiLU and product); x L
    without checkpointing, or each layer's input (2h x L) plus one layer recomputed (a) with it."""
    a = 16 * s.hidden + 4 * s.d_kv + 8 * s.intermediate
    return 2 * s.hidden * s.layers + a if checkpointing else a * s.layers


def logits_bytes_per_token(s: ModelShape) -> int:
    """Per generated token (the only positions projected to the vocabulary): the bf16 logits, their fp32
    copy and the log-softmax, 10V bytes."""
    return 10 * s.vocab


def kv_bytes_per_token(s: ModelShape, tensor_parallel: int = 1) -> int:
    """vLLM's KV cache per token on one GPU: K and V in bf16 for every layer, 4·L·d_kv, split over TP."""
    return 4 * s.layers * s.d_kv // max(1, tensor_parallel)


@dataclass
class LearnerEstimate:
    states: int
    working_set: int
    reference: int
    activations: int  # at the token budget, without checkpointing
    activations_ckpt: int  # the same with per-layer activation checkpointing
    logits: int
    checkpointing: bool  # which of the two the run uses

    @property
    def total(self) -> int:
        return self.states + self.working_set + self.reference + self.logits + (
            self.activations_ckpt if self.checkpointing else self.activations)


def learner(s: ModelShape, ranks: int, stage: int, token_budget: int, generated_tokens: int,
            offload: bool = False, reference: bool = False, checkpointing: bool = False) -> LearnerEstimate:
    """One learner rank: 16Ψ/N (by stage) + working set + a reference policy (an fp32 copy, 4Ψ, for
    recipes with a KL term) + T x activations + R x 10V, T = optim.token_budget, R generated tokens."""
    psi = param_count(s)
    return LearnerEstimate(states=model_states_bytes(psi, ranks, stage, offload),
                           working_set=working_set_bytes(s, stage),
                           reference=4 * psi if reference else 0,
                           activations=token_budget * activation_bytes_per_token(s, False),
                           activations_ckpt=token_budget * activation_bytes_per_token(s, True),
                           logits=generated_tokens * logits_bytes_per_token(s), checkpointing=checkpointing)


@dataclass
class ServerEstimate:
    weights: int  # on one of its GPUs
    share: int  # what vLLM reserves on that GPU (gpu_memory_utilization x the card)
    kv_tokens: int  # tokens of KV cache left in the share (all sequences in flight together)


def server(s: ModelShape, card_bytes: int, fraction: float, tensor_parallel: int = 1) -> ServerEstimate:
    """A vLLM server's GPU: bf16 weights 2Ψ/TP, and the tokens of KV cache its share holds after them
    (vLLM's own activations and CUDA graphs come out of the same share, so a little fewer in practice)."""
    weights = 2 * param_count(s) // max(1, tensor_parallel)
    share = int(card_bytes * fraction)
    return ServerEstimate(weights, share, max(0, share - weights) // kv_bytes_per_token(s, tensor_parallel))


def largest_token_budget(s: ModelShape, budget_bytes: int, ranks: int, stage: int, generated_share: float = 0.2,
                         offload: bool = False, reference: bool = False, checkpointing: bool = False) -> int:
    """The largest optim.token_budget T whose learner estimate fits ``budget_bytes`` (R = share x T):
    solves states + working set + reference + T·(activations + share·10V) = budget."""
    fixed = learner(s, ranks, stage, 0, 0, offload, reference, checkpointing).total
    per = activation_bytes_per_token(s, checkpointing) + generated_share * logits_bytes_per_token(s)
    return max(0, int((budget_bytes - fixed) / per))
