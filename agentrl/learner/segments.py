"""Attention over packed rows one sequence at a time (``optim.packing``).

A packed row holds several sequences, each one's positions restarting at 0. Given no attention mask,
transformers reads the restarts as sequence boundaries and builds a dense block-diagonal mask over the whole
row, and SDPA with an arbitrary mask computes every query-key score of it: L^2 for L packed tokens, 4x the
padded micro-batch's attention on ALFWorld's full-chat rows (docs/studies/learner-packing.md). Here the
decoder's attention runs SDPA causally on each sequence's slice instead: sum of l^2 / 2 scores, no mask
built, the same outputs.

``use`` switches a model from transformers' ``sdpa`` to ``SEGMENTS``, which is ``sdpa`` everywhere but on a
row with restarts and no mask and on a decode step that carries a ``cascade`` cache (the embedded generator's,
``agentrl.generation.cascade``, which attends itself), so padded passes, the shared-prefix pass and the
generator's prefill run as before.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

SEGMENTS = "agentrl_segments"


def use(model: Any) -> bool:
    """Switch ``model`` (its config, shared by every layer) to segment attention where that is exact: an
    ``sdpa`` model whose layers all attend causally to the whole sequence (a sliding window or a per-layer
    pattern would need its mask inside each sequence). True when ``model`` runs segment attention."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl == SEGMENTS:
        return True
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if impl != "sdpa" or getattr(config, "sliding_window", None) or layer_types != {"full_attention"}:
        return False
    _register()
    config._attn_implementation = SEGMENTS
    return True


def serves(model: Any) -> bool:
    """Whether a packed row runs on ``model`` without a dense mask over the whole row: segment attention
    (``use``), or FlashAttention's varlen kernels, which transformers drives from the position ids."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return impl in ("flash_attention_2", "flash_attention_3") or use(model)


def packing_for(model: Any, packing: bool) -> bool:
    """``optim.packing`` as the engines run it on ``model``: off, with a note, where a packed row would need a
    dense mask over it (eager attention, a sliding window: several times the padded cost, measured)."""
    if packing and not serves(model):
        print("note: optim.packing runs padded for this model (its attention would need a dense mask over each "
              "packed row: eager attention or a sliding window)", flush=True)
        return False
    return packing


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(SEGMENTS, segment_attention)
    AttentionMaskInterface.register(SEGMENTS, _mask)


def _mask(*, mask_function: Any = None, attention_mask: torch.Tensor | None = None, q_length: int = 0,
          kv_length: int = 0, q_offset: Any = 0, kv_offset: Any = 0, **kwargs: Any) -> torch.Tensor | None:
    """transformers' SDPA mask, except that a plain causal pass with no padding gets none (``packed_hidden``
    hands its packed row an all-ones mask, so transformers does not build the block-diagonal one):
    ``segment_attention`` then runs causally on each sequence."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    plain = (mask_function is causal_mask_function and q_length == kv_length
             and isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset == 0)
    if plain and (attention_mask is None or bool(attention_mask.all())):
        return None
    return sdpa_mask(mask_function=mask_function, attention_mask=attention_mask, q_length=q_length,
                     kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset, **kwargs)


def segment_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention; on rows (B, heads, L, D) with no mask whose ``position_ids`` restart at 0,
    SDPA causal on each sequence's slice (a row may hold several; each row its own)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    shared = kwargs.pop("cascade", None)
    if shared is not None:  # an embedded generator's decode step over keys its rows share (generation/cascade.py)
        return shared.attend(module, query, key, value, scaling, **kwargs)
    pos = kwargs.get("position_ids")
    L = query.shape[2]
    if attention_mask is not None or pos is None or L < 2 or key.shape[2] != L or pos.shape[-1] != L:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    bounds = _bounds_of(pos)
    bounds = bounds * query.shape[0] if len(bounds) == 1 else bounds
    if all(len(b) == 2 for b in bounds):  # one sequence a row: plain causal
        return sdpa_attention_forward(module, query, key, value, None, dropout, scaling, **kwargs)
    rows = []
    for r, b in enumerate(bounds):
        rows.append(torch.cat([sdpa_attention_forward(module, query[r:r + 1, :, s:e], key[r:r + 1, :, s:e],
                                                      value[r:r + 1, :, s:e], None, dropout, scaling,
                                                      is_causal=True)[0]
                               for s, e in zip(b[:-1], b[1:])], dim=1))
    return torch.cat(rows, dim=0), None


# Every layer of one forward gets the same position_ids tensor: its bounds are read from the device once a
# forward (and once more for a checkpointed recomputation's), not once a layer (a sync each on CUDA).
_last: tuple[Any, int, list[list[int]]] | None = None


def _bounds_of(position_ids: torch.Tensor) -> list[list[int]]:
    global _last
    if position_ids.is_inference():  # no version counter to tell an edit in place: read it every time
        return sequence_bounds(position_ids.reshape(-1, position_ids.shape[-1]))
    last = _last  # one read of the global: another thread may replace it, never half-way
    if last is not None and last[0]() is position_ids and last[1] == position_ids._version:
        return last[2]
    bounds = sequence_bounds(position_ids.reshape(-1, position_ids.shape[-1]))
    _last = (weakref.ref(position_ids), position_ids._version, bounds)
    return bounds


def sequence_bounds(position_ids: torch.Tensor) -> list[list[int]]:
    """Per row of (B, L) position ids, where its sequences start and the row's end: each 0 after the first
    position starts one (``packed_hidden``'s rows: every sequence from 0)."""
    starts = (position_ids[:, 1:] == 0).nonzero().tolist()  # one read of the device for all rows
    out = [[0] for _ in range(position_ids.shape[0])]
    for r, i in starts:
        out[r].append(i + 1)
    L = position_ids.shape[1]
    return [b + [L] for b in out]
