"""Decode attention that reads keys several rows share once (cascade attention), for the embedded generator.

The rows of a generation share keys: every prompt of an env starts with the same instructions, and a GRPO
group repeats one prompt for each of its completions. A static cache holds a copy of them per row, and every
decode step reads every copy: memory-bound work, ~45% of a GRPO generation's time on the tiny model
(8 prompts x 4 completions). Here the cache keeps levels instead (``Level``: the prefix all prompts share,
one row; each distinct prompt's rest, one row per prompt) beside each row's generated tokens. A step
multiplies the queries of all rows under a level row with its keys at once, softmaxes each row's scores of all
levels and its own keys together and sums the levels' values: attention over each row's whole sequence,
computed exactly (tests/test_generation.py), each shared key read once a step.

(The learner's prefix-tree pass was tried with the same attention over each group's prompt and measured no
faster on a CPU: there its T queries a row make the scores' arithmetic, not the keys' reads, the cost.)

transformers runs the model (embeddings, projections, rotary positions, MLPs) with agentrl's attention
function (``agentrl.learner.segments``, the one packed rows use), which hands a forward pass carrying a
``CascadeCache`` (the ``cascade`` keyword) to ``CascadeCache.attend``; every other pass, in any thread, runs as
before. It applies to models whose layers all attend to the whole sequence with transformers' SDPA
(``applies``); the generator keeps transformers' static cache for the others (a sliding window, eager attention).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

from agentrl.learner import segments


def applies(model: Any) -> bool:
    """Whether the cascade decode runs on ``model``: it then runs agentrl's attention function (switched to it
    here where that is exact, ``segments.use``: SDPA, every layer over the whole sequence)."""
    return segments.use(model)


@dataclass
class Level:
    """Keys several rows read: ``keys``/``values`` per layer (G, kv heads, L, head dim) for G level rows,
    ``valid`` (G, L) their real positions (None: all), ``of_row`` (R,) the level row each live row reads."""
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor | None
    of_row: torch.Tensor

    def __post_init__(self) -> None:
        self._index()

    def keep(self, rows: torch.Tensor) -> None:
        self.of_row = self.of_row[rows]
        self._index()

    def _index(self) -> None:
        # a row's place among the live rows under its level row; width: the most rows under one
        g = self.of_row.tolist()
        seen: dict[int, int] = {}
        slots = []
        for x in g:
            slots.append(seen.get(x, 0))
            seen[x] = slots[-1] + 1
        self.groups, self.width = self.keys[0].shape[0], max(seen.values())
        flat = [x * self.width + j for x, j in zip(g, slots)]
        # every level row's rows in order and as many (a GRPO batch before any row ends): no regrouping
        self.uniform = flat == list(range(self.groups * self.width))
        self.flat = torch.tensor(flat, device=self.of_row.device)
        self.masked = None if self.valid is None else ~self.valid[self.of_row][:, None, None, :]

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """(R, kv heads, m, n) -> (G, kv heads, width * m, n): each level row's rows side by side."""
        R, h, m, n = x.shape
        if not self.uniform:
            x = x.new_zeros(self.groups * self.width, h, m, n).index_copy_(0, self.flat, x)
        return x.reshape(self.groups, self.width, h, m, n).transpose(1, 2).reshape(self.groups, h, self.width * m, n)

    def _rows(self, y: torch.Tensor, m: int) -> torch.Tensor:
        """``_grouped``'s inverse: (G, kv heads, width * m, n) -> (R, kv heads, m, n)."""
        G, h, _, n = y.shape
        y = y.view(G, h, self.width, m, n).transpose(1, 2).reshape(G * self.width, h, m, n)
        return y if self.uniform else y.index_select(0, self.flat)

    def scores(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q (R, kv heads, n, D) -> (R, kv heads, n, L) against this level's keys."""
        return self._rows(torch.matmul(self._grouped(q), self.keys[layer].transpose(-1, -2)), q.shape[2])

    def output(self, layer: int, p: torch.Tensor) -> torch.Tensor:
        """p (R, kv heads, n, L) -> (R, kv heads, n, value dim): the weighted sum of this level's values."""
        return self._rows(torch.matmul(self._grouped(p), self.values[layer]), p.shape[2])


class CascadeCache(Cache):
    """The levels' keys and each live row's generated tokens' keys, up to ``max_new``. ``update`` writes a
    decode step's keys at the step's index; ``advance`` moves to the next after a forward pass; ``keep``
    drops finished rows (only their own keys: the levels are shared)."""

    def __init__(self, levels: list[Level], rows: int, max_new: int):
        super().__init__(layers=[])
        self.levels = levels
        self.own_k = [k.new_empty(rows, k.shape[1], max_new, k.shape[3]) for k in levels[0].keys]
        self.own_v = [v.new_empty(rows, v.shape[1], max_new, v.shape[3]) for v in levels[0].values]
        self.n = 0  # tokens generated so far
        self.attended = [0] * len(self.own_k)  # steps each layer attended through ``attend`` (a check)

    def __len__(self) -> int:
        return len(self.own_k)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[2] != 1:
            raise ValueError("a cascade cache takes one token a row a step (decoding only)")
        k, v = self.own_k[layer_idx], self.own_v[layer_idx]
        k[:, :, self.n] = key_states[:, :, 0]
        v[:, :, self.n] = value_states[:, :, 0]
        return k[:, :, :self.n + 1], v[:, :, :self.n + 1]

    def advance(self) -> None:
        if any(a != self.n + 1 for a in self.attended):  # it ran another attention over its own keys only
            raise RuntimeError("a layer of this model did not attend through the cascade cache, which does not "
                               "apply to it")
        self.n += 1

    def keep(self, rows: torch.Tensor) -> None:
        self.own_k = [k[rows] for k in self.own_k]
        self.own_v = [v[rows] for v in self.own_v]
        for level in self.levels:
            level.keep(rows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return sum(level.keys[0].shape[2] for level in self.levels) + self.n

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return query_length, 0  # transformers builds no mask (a plain causal step): ``attend`` takes none

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """One decode step's attention, queries (R, heads, 1, D), over the levels and the rows' own keys
        (``key``/``value``: what ``update`` returned). Scores in the model's dtype, softmax in float32
        (transformers' eager attention); no attention mask: the levels carry their padding."""
        if query.shape[2] != 1:
            raise RuntimeError("a cascade cache attends one token a row a step (decoding only)")
        if kwargs.get("sliding_window") or kwargs.get("softcap") or kwargs.get("s_aux") is not None:
            raise RuntimeError("this model's attention has a window, soft-capping or sink logits, which the "
                               "cascade decode does not compute")
        layer = module.layer_idx
        R, H, _, D = query.shape
        kv_heads = key.shape[1]
        q = query.reshape(R, kv_heads, H // kv_heads, D)  # query head h reads kv head h // rep (repeat_kv's order)
        parts = []
        for level in self.levels:
            s = level.scores(layer, q)
            if level.masked is not None:
                s = s.masked_fill(level.masked, float("-inf"))
            parts.append(s)
        parts.append(torch.matmul(q, key.transpose(-1, -2)))
        scale = scaling if scaling is not None else D ** -0.5
        p = torch.softmax(torch.cat(parts, dim=-1) * scale, dim=-1, dtype=torch.float32).to(query.dtype)
        out, start = None, 0
        for level in self.levels:
            n = level.keys[layer].shape[2]
            o = level.output(layer, p[..., start:start + n])
            out, start = o if out is None else out + o, start + n
        out = out + torch.matmul(p[..., start:], value)
        self.attended[layer] += 1
        return out.reshape(R, 1, H, -1), None
