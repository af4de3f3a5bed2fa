"""From episodes to padded token tensors.

A ``Sample`` is one training sequence: token ids, a loss mask that is 1 exactly on policy-generated
tokens, and per-token rollout log-probs and advantages (0 where the mask is 0). ``TokenBatch`` right-pads
samples and shifts everything to target positions: row t of the (B, T-1) tensors is about token t+1.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

import torch

from agentrl.types import Episode


@dataclass
class Sample:
    ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]
    advantages: list[float]
    returns: list[float] = field(default_factory=list)
    old_values: list[float] = field(default_factory=list)
    ref_logprobs: list[float] = field(default_factory=list)
    value_mask: list[int] = field(default_factory=list)  # where the value loss applies (PPO), 1 per state
    meta: dict = field(default_factory=dict)
    tag: int = 0  # which part of a recipe's objective the row feeds (SPEAR: 1 = self-imitation replay)
    # position in ``ids`` -> the token ids that token was drawn among (constrained decoding, ``Turn.gen_allowed``)
    allowed: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.ids)
        for name in ("loss_mask", "old_logprobs", "advantages"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"sample {name} has {len(getattr(self, name))} entries for {n} tokens")

    @property
    def num_targets(self) -> int:
        return sum(self.loss_mask)


def turn_sample(prompt_ids: list[int], gen_ids: list[int], gen_logprobs: list[float], advantage: float | list[float],
                meta: dict | None = None, gen_allowed: list[list[int]] | None = None) -> Sample:
    """One turn as one sequence (window mode): prompt tokens are context, generated tokens are targets.
    ``gen_allowed``: the turn's constrained-decoding id lists (``Turn.gen_allowed``), one per generated token."""
    adv = advantage if isinstance(advantage, list) else [advantage] * len(gen_ids)
    p = len(prompt_ids)
    return Sample(prompt_ids + gen_ids, [0] * p + [1] * len(gen_ids), [0.0] * p + list(gen_logprobs),
                  [0.0] * p + list(adv), meta=dict(meta or {}),
                  allowed={p + j: ids for j, ids in enumerate(gen_allowed or [])})


def episode_sample(ep: Episode, turn_advantages: Sequence[float], meta: dict | None = None) -> Sample:
    """A full-chat episode (RAGEN trajectory-level) as one sequence: the last prompt already holds every
    earlier prompt and generation verbatim, so each turn's generated span is located and masked in."""
    last = ep.turns[-1]
    ids = last.prompt_ids + last.gen_ids
    mask, lp, adv = [0] * len(ids), [0.0] * len(ids), [0.0] * len(ids)
    allowed: dict[int, list[int]] = {}
    for turn, a in zip(ep.turns, turn_advantages):
        start = len(turn.prompt_ids)
        if ids[start:start + len(turn.gen_ids)] != turn.gen_ids:
            raise ValueError(f"episode {ep.task_id}: turn prompts are not nested (was it rolled out in full mode?)")
        for j in range(len(turn.gen_ids)):
            mask[start + j], lp[start + j], adv[start + j] = 1, turn.gen_logprobs[j], a
        allowed.update({start + j: a_ids for j, a_ids in enumerate(turn.gen_allowed)})
    return Sample(ids, mask, lp, adv, meta=dict(meta or {}), allowed=allowed)


def with_token_targets(s: Sample, advantages: Sequence[float], returns: Sequence[float],
                       values: Sequence[float]) -> Sample:
    """Per-token advantages and critic targets on a sample's generated tokens, in order (token-level GAE).
    Each value sits at its token's position, like the loss mask (``collate`` shifts both onto targets)."""
    where = [i for i, m in enumerate(s.loss_mask) if m]
    if not len(where) == len(advantages) == len(returns) == len(values):
        raise ValueError(f"{len(where)} generated tokens but {len(advantages)} advantages, {len(returns)} returns, "
                         f"{len(values)} values")
    n = len(s.ids)
    s.advantages, s.returns, s.old_values, s.value_mask = [0.0] * n, [0.0] * n, [0.0] * n, [0] * n
    for i, a, r, v in zip(where, advantages, returns, values):
        s.advantages[i], s.returns[i], s.old_values[i], s.value_mask[i] = a, r, v, 1
    return s


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    loss_mask: torch.Tensor  # (B, T-1), on target positions
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    old_values: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    value_mask: torch.Tensor | None = None
    tags: torch.Tensor | None = None  # (B,) Sample.tag
    # (B, T-1, K): the ids each target was drawn among, -1-padded; a target with none was drawn from the
    # whole vocabulary. None when no row was constrained
    allowed: torch.Tensor | None = None

    @property
    def num_targets(self) -> int:
        return int(self.loss_mask.sum())

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: str | torch.device) -> "TokenBatch":
        """The same batch on ``device`` (itself when already there)."""
        if self.input_ids.device == torch.device(device):
            return self
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return TokenBatch(*(mv(getattr(self, f.name)) for f in fields(self)))

    def select(self, idx: list[int]) -> "TokenBatch":
        i = torch.tensor(idx)
        width = int(self.attention_mask[i].sum(-1).max())  # trim the shared right padding
        cut = lambda t: None if t is None else t[i][:, :max(1, width - 1)]  # noqa: E731
        return TokenBatch(self.input_ids[i][:, :width], self.attention_mask[i][:, :width], cut(self.loss_mask),
                          cut(self.old_logprobs), cut(self.advantages), cut(self.returns), cut(self.old_values),
                          cut(self.ref_logprobs), cut(self.value_mask),
                          None if self.tags is None else self.tags[i], cut(self.allowed))


def collate(samples: Sequence[Sample], pad_id: int) -> TokenBatch:
    width = max(len(s.ids) for s in samples)
    B = len(samples)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    att = torch.zeros((B, width), dtype=torch.long)
    tgt = {k: torch.zeros((B, width - 1)) for k in ("mask", "lp", "adv", "ret", "val", "ref", "vmask")}
    for b, s in enumerate(samples):
        n = len(s.ids)
        ids[b, :n] = torch.tensor(s.ids)
        att[b, :n] = 1
        tgt["mask"][b, :n - 1] = torch.tensor(s.loss_mask[1:], dtype=torch.float)
        tgt["lp"][b, :n - 1] = torch.tensor(s.old_logprobs[1:])
        tgt["adv"][b, :n - 1] = torch.tensor(s.advantages[1:])
        if s.returns:
            tgt["ret"][b, :n - 1] = torch.tensor(s.returns[1:])
        if s.old_values:
            tgt["val"][b, :n - 1] = torch.tensor(s.old_values[1:])
        if s.ref_logprobs:
            tgt["ref"][b, :n - 1] = torch.tensor(s.ref_logprobs[1:])
        if s.value_mask:
            tgt["vmask"][b, :n - 1] = torch.tensor(s.value_mask[1:], dtype=torch.float)
    has_ref = any(s.ref_logprobs for s in samples)
    has_v = any(s.value_mask for s in samples)
    return TokenBatch(ids, att, tgt["mask"], tgt["lp"], tgt["adv"], tgt["ret"], tgt["val"],
                      tgt["ref"] if has_ref else None, tgt["vmask"] if has_v else None,
                      torch.tensor([s.tag for s in samples]), allowed_targets(samples, width))


def allowed_targets(samples: Sequence[Sample], width: int) -> torch.Tensor | None:
    """``Sample.allowed`` of each row on target positions (token t at row t-1), as one (B, width-1, K) tensor
    padded with -1; None when no sample was constrained."""
    # getattr: a Sample pickled in a checkpoint (SPEAR's replay buffer) before the field existed lacks it
    rows = [getattr(s, "allowed", {}) for s in samples]
    k = max((len(ids) for allowed in rows for ids in allowed.values()), default=0)
    if not k:
        return None
    out = torch.full((len(samples), width - 1, k), -1, dtype=torch.long)
    for b, allowed in enumerate(rows):
        for pos, ids in allowed.items():
            out[b, pos - 1, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def row_blocks(n_rows: int, block: int) -> list[list[int]]:
    """Rows in consecutive blocks of ``block`` that a loss couples (DPO: chosen and rejected of a pair)."""
    if block < 1 or n_rows % block:
        raise ValueError(f"{n_rows} rows do not split into blocks of {block}")
    return [list(range(i, i + block)) for i in range(0, n_rows, block)]


def micro_batches(batch: TokenBatch, token_budget: int, block: int = 1) -> list[list[int]]:
    """Split row indices into micro-batches of at most ``token_budget`` padded tokens (rows sorted by
    length so padding stays small); a row longer than the budget gets a micro-batch of its own.
    ``block`` > 1 keeps each block of consecutive rows together, in order (see ``row_blocks``)."""
    lengths = batch.attention_mask.sum(-1).tolist()
    blocks = row_blocks(len(lengths), block)
    size = [max(lengths[i] for i in b) for b in blocks]
    order = sorted(range(len(blocks)), key=lambda k: size[k])
    out: list[list[int]] = []
    cur: list[int] = []
    width = 0
    for k in order:
        if cur and max(width, size[k]) * (len(cur) + block) > token_budget:
            out.append(cur)
            cur, width = [], 0
        cur += blocks[k]
        width = max(width, size[k])
    if cur:
        out.append(cur)
    return out


def deal_rows(lengths: Sequence[int], world: int, block: int = 1) -> list[list[int]]:
    """Row blocks dealt to ``world`` ranks balanced by tokens: the longest block first, each to the rank
    holding the fewest tokens so far (ties: the lower rank); each rank's rows in ascending order. The same
    on every rank (it reads only ``lengths``), so no rank needs to be told its share."""
    blocks = row_blocks(len(lengths), block)
    size = [sum(lengths[i] for i in b) for b in blocks]
    load, dealt = [0] * world, [[] for _ in range(world)]
    for k in sorted(range(len(blocks)), key=lambda k: (-size[k], k)):
        r = min(range(world), key=lambda r: (load[r], r))
        load[r] += size[k]
        dealt[r] += blocks[k]
    return [sorted(rows) for rows in dealt]


def stand_in_rows(lengths: Sequence[int], block: int = 1) -> list[int]:
    """The shortest row block: what a rank with fewer micro-batches than another runs, with weight 0, so
    every rank takes part in the same number of collective passes at the least cost."""
    blocks = row_blocks(len(lengths), block)
    return min(blocks, key=lambda b: (max(lengths[i] for i in b), b[0]))
