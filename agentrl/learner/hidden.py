"""The decoder's last hidden states over a token batch, with a shared prompt prefix run once: used by the
policy's forward pass and by the separate critic alike."""
from __future__ import annotations

from typing import Any

import torch

from agentrl.learner import segments
from agentrl.learner.batch import TokenBatch, packed_computes_less
from agentrl.prefix import prefix_levels, shared_prefix_len


def batch_prefix_len(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """``shared_prefix_len`` over the real tokens of a right-padded batch; 0 when a row is left-padded
    (its leading positions are not tokens)."""
    if not bool(attention_mask[:, 0].all()):
        return 0
    return shared_prefix_len([row[:n] for row, n in zip(input_ids.tolist(), attention_mask.sum(-1).tolist())])


def decoder_hidden(decoder: Any, mb: TokenBatch, pos: torch.Tensor, shared_prefix: bool = True,
                   prefix_tree: bool = False) -> torch.Tensor:
    """Last hidden states (B, T, H). Rows sharing a prefix (an agent's system prompt and task rules:
    ~180 of Sokoban's ~275 tokens) run it once: one pass over the prefix at batch 1, its keys and values
    repeated per row, then the rows' own tokens. Gradients flow back through the repeated cache into the
    one prefix pass, so results equal the full pass (test) at about a third of the work on Sokoban.
    ``prefix_tree``: also run what only some rows share once per distinct prefix (``prefix_levels``: a
    GRPO group's prompt once for its completions); off where every rank must make the same calls (ZeRO-3)."""
    from transformers import DynamicCache

    # a checkpointed layer drops the key/value cache the prefix pass hands on (HF recomputes it without one)
    shared_prefix = shared_prefix and not (decoder.training and getattr(decoder, "gradient_checkpointing", False))
    B, T = mb.input_ids.shape
    levels: list[tuple[int, list[int]]] = []
    if shared_prefix and prefix_tree and bool(mb.attention_mask[:, 0].all()):
        levels = prefix_levels([r[:n] for r, n in zip(mb.input_ids.tolist(), mb.attention_mask.sum(-1).tolist())], T)
    elif shared_prefix and (n := batch_prefix_len(mb.input_ids, mb.attention_mask)):
        levels = [(n, [0] * B)]
    if not levels:
        return decoder(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=pos,
                       use_cache=False).last_hidden_state
    dev = mb.input_ids.device
    cache = DynamicCache(config=decoder.config)
    parts, start, prev = [], 0, [0] * B
    for end, group in levels:
        first = {}  # a row of each distinct prefix
        for row, g in enumerate(group):
            first.setdefault(g, row)
        reps = [first[g] for g in range(len(first))]
        if start:  # each group's cache is its parent's (the pass before)
            _pick_cache(cache, torch.tensor([prev[r] for r in reps], device=dev))
        idx = torch.tensor(reps, device=dev)
        h = decoder(input_ids=mb.input_ids[idx, start:end], attention_mask=mb.attention_mask[idx, :end],
                    position_ids=pos[idx, start:end], past_key_values=cache, use_cache=True,
                    cache_position=torch.arange(start, end, device=dev)).last_hidden_state
        parts.append(h.expand(B, -1, -1) if len(reps) == 1 else pick_rows(h, torch.tensor(group, device=dev)))
        start, prev = end, group
    if len(set(prev)) == 1:
        cache.batch_repeat_interleave(B)
    else:
        _pick_cache(cache, torch.tensor(prev, device=dev))
    tail = decoder(input_ids=mb.input_ids[:, start:], attention_mask=mb.attention_mask, position_ids=pos[:, start:],
                   past_key_values=cache, use_cache=True,
                   cache_position=torch.arange(start, T, device=dev)).last_hidden_state
    return torch.cat([*parts, tail], dim=1)


class _PickRows(torch.autograd.Function):
    """``x.index_select(0, index)``, whose backward adds up a contiguous copy of the gradient: torch's
    ``index_add_`` on a CPU scatters through an index as large as the gradient, and on a strided one (a
    cache's keys: heads before positions) took ~20x as long (4.5 vs 0.23 ms for a GRPO batch's layer;
    the prefix tree's picks were a tenth of the update's time)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        return grad.new_zeros((ctx.rows, *grad.shape[1:])).index_add_(0, index, grad.contiguous()), None


def pick_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of ``x`` (a row may repeat), differentiable."""
    return _PickRows.apply(x, index)


def _pick_cache(cache: Any, index: torch.Tensor) -> None:
    """A transformers cache's rows ``index``, in that order (``reorder_cache`` with ``pick_rows``)."""
    for layer in cache.layers:
        layer.keys, layer.values = pick_rows(layer.keys, index), pick_rows(layer.values, index)


def pack_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T): where each token of a right-padded batch sits in its packed row (the real tokens of every row
    concatenated in row order); a padding position reads its row's last token (callers mask it)."""
    return (attention_mask.flatten().cumsum(0) - 1).clamp(min=0).view(attention_mask.shape)


def packed_hidden(decoder: Any, mb: TokenBatch) -> torch.Tensor:
    """Last hidden states (L, H) of the batch's real tokens packed into one row, each row's positions
    restarting at 0, so no padding is computed and no token attends to another row. An ``sdpa`` decoder runs
    attention on each row's slice (``agentrl.learner.segments``: the row's mask is all ones, so transformers
    builds none); on others transformers reads the restarts as boundaries with no attention mask
    (``masking_utils.find_packed_sequence_indices``: a dense block-diagonal mask for eager attention,
    FlashAttention's varlen kernels on GPUs)."""
    real = mb.attention_mask.bool()
    pos = (mb.attention_mask.cumsum(-1) - 1).clamp(min=0)
    ids = mb.input_ids[real][None]
    mask = torch.ones_like(ids) if segments.use(decoder) else None
    return decoder(input_ids=ids, attention_mask=mask, position_ids=pos[real][None],
                   use_cache=False).last_hidden_state[0]


def packs(mb: TokenBatch, packing: bool, shared_prefix: bool) -> bool:
    """Whether micro-batch ``mb`` runs packed: with ``optim.packing``, when it has rows to pack and computes
    fewer token positions than the padded pass with its shared prefix run once (a batch of equal rows
    sharing a long system prompt is cheaper padded; uneven rows are cheaper packed)."""
    if not packing or len(mb) < 2:
        return False
    lengths = mb.lengths
    n = batch_prefix_len(mb.input_ids, mb.attention_mask) if shared_prefix else 0
    return packed_computes_less(sum(lengths), len(lengths), max(lengths), n)
