"""From episodes to padded token tensors.

A ``Sample`` is one training sequence: token ids, a loss mask that is 1 exactly on policy-generated
tokens, and per-token rollout log-probs and advantages (0 where the mask is 0). ``TokenBatch`` right-pads
samples and shifts everything to target positions: row t of the (B, T-1) tensors is about token t+1.
``TokenBatch.from_samples`` builds each tensor when first read and only for the rows selected, so a learner
rank collates only the rows it runs; ``collate`` builds them all at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Sequence

import numpy as np
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
    """Padded token tensors of a batch's rows. A batch made by ``from_samples`` keeps its samples and collates
    each tensor the first time it is read, for its own rows only: ``select`` of such a batch collates nothing,
    so a rank that runs a share of the batch only ever builds that share's tensors. A tensor assigned to a
    field (a learner pass's log-probs) is the batch's from then on, and ``select`` takes its rows."""
    # no defaults: a class attribute would hide ``__getattr__``, which collates a field not yet read
    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    loss_mask: torch.Tensor  # (B, T-1), on target positions
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    old_values: torch.Tensor
    ref_logprobs: torch.Tensor | None
    value_mask: torch.Tensor | None
    tags: torch.Tensor | None  # (B,) Sample.tag
    # (B, T-1, K): the ids each target was drawn among, -1-padded; a target with none was drawn from the
    # whole vocabulary. None when no row was constrained
    allowed: torch.Tensor | None

    @classmethod
    def from_samples(cls, samples: Sequence[Sample], pad_id: int) -> "TokenBatch":
        """The batch of ``samples``, right-padded with ``pad_id``, its tensors collated when first read."""
        batch = cls.__new__(cls)
        batch._rows = _Rows.of(samples, pad_id)
        return batch

    def __getattr__(self, name: str) -> Any:
        rows = self.__dict__.get("_rows")  # only reached for a field this batch has not collated yet
        if rows is None or name not in _FIELDS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = rows.field(name)
        setattr(self, name, value)
        return value

    @property
    def lengths(self) -> list[int]:
        """Each row's token count (read from the samples when there are some: no tensor collated)."""
        rows = self.__dict__.get("_rows")
        return list(rows.lengths) if rows is not None else self.attention_mask.sum(-1).tolist()

    @property
    def target_shape(self) -> tuple[int, int]:
        """(B, T-1): the shape of the per-target tensors."""
        rows = self.__dict__.get("_rows")
        return (len(rows.samples), rows.target_width) if rows is not None else tuple(self.loss_mask.shape)

    @property
    def num_targets(self) -> int:
        rows = self.__dict__.get("_rows")
        if rows is not None and "loss_mask" not in self.__dict__:
            return int(sum(sum(s.loss_mask[1:]) for s in rows.samples))
        return int(self.loss_mask.sum())

    def any_advantage(self) -> bool:
        """Whether a generated token has a non-zero advantage (read from the samples while neither tensor is
        collated: a rank does not build the whole batch to learn that a step has nothing to learn)."""
        rows = self.__dict__.get("_rows")
        if rows is not None and "advantages" not in self.__dict__ and "loss_mask" not in self.__dict__:
            return any(a != 0 and m for s in rows.samples for a, m in zip(s.advantages[1:], s.loss_mask[1:]))
        return bool((self.advantages * self.loss_mask).abs().gt(0).any())

    def __len__(self) -> int:
        return len(self.lengths)

    def to(self, device: str | torch.device) -> "TokenBatch":
        """The same batch on ``device`` (itself when already there)."""
        if self.input_ids.device == torch.device(device):
            return self
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return TokenBatch(*(mv(getattr(self, f.name)) for f in fields(self)))

    def select(self, idx: list[int]) -> "TokenBatch":
        """Rows ``idx``, trimmed to their own longest row: the tensors this batch holds are sliced, the others
        are collated from the rows' samples when read."""
        rows = self.__dict__.get("_rows")
        i = torch.tensor(idx, dtype=torch.long)
        sub = TokenBatch.__new__(TokenBatch)
        if rows is not None:
            sub._rows = rows.subset(idx)
            width = max(1, max((rows.lengths[k] for k in idx), default=1))
        else:
            width = int(self.attention_mask[i].sum(-1).max())  # trim the shared right padding
        held = self.__dict__
        for name in _FIELDS:
            if name in held:
                t = held[name]
                if t is None or name == "tags":
                    value = None if t is None else t[i]
                elif name in ("input_ids", "attention_mask"):
                    value = t[i][:, :width]
                else:
                    value = t[i][:, :max(1, width - 1)]
                setattr(sub, name, value)
        return sub


_FIELDS = frozenset(f.name for f in fields(TokenBatch))


@dataclass
class _Rows:
    """Samples that a batch collates on demand, and what the batch they were first collated in fixed for
    every later selection of them (the target width's cap, which optional tensors exist, the allowed-ids
    width), so a selection's tensors equal the same rows of the whole batch's."""
    samples: list[Sample]
    lengths: list[int]
    pad_id: int
    target_width: int
    max_target_width: int
    has_ref: bool
    has_value_mask: bool
    allowed_k: int

    @classmethod
    def of(cls, samples: Sequence[Sample], pad_id: int) -> "_Rows":
        samples = list(samples)
        lengths = [len(s.ids) for s in samples]
        tw = max(lengths, default=1) - 1
        # getattr: a Sample pickled in a checkpoint (SPEAR's replay buffer) before the field existed lacks it
        k = max((len(ids) for s in samples for ids in getattr(s, "allowed", {}).values()), default=0)
        return cls(samples, lengths, pad_id, tw, tw, any(s.ref_logprobs for s in samples),
                   any(s.value_mask for s in samples), k)

    def subset(self, idx: Sequence[int]) -> "_Rows":
        lengths = [self.lengths[k] for k in idx]
        # as slicing the whole batch's tensors would: at least one target column, never wider than the batch's
        tw = min(max(1, max(lengths, default=1) - 1), self.max_target_width)
        return _Rows([self.samples[k] for k in idx], lengths, self.pad_id, tw, self.max_target_width, self.has_ref,
                     self.has_value_mask, self.allowed_k)

    def field(self, name: str) -> torch.Tensor | None:
        """One field's tensor for these rows. Each row's list goes to numpy in one call (many times faster
        than ``torch.tensor`` on a list); float32 rounding is the same."""
        B, width = len(self.samples), max(self.lengths, default=1)
        if name == "tags":
            return torch.tensor([s.tag for s in self.samples], dtype=torch.long)
        if name in ("input_ids", "attention_mask"):
            out = np.full((B, width), self.pad_id if name == "input_ids" else 0, dtype=np.int64)
            for b, s in enumerate(self.samples):
                out[b, :len(s.ids)] = s.ids if name == "input_ids" else 1
            return torch.from_numpy(out)
        if name == "allowed":
            return allowed_targets(self.samples, self.target_width + 1, self.allowed_k)
        if (name == "ref_logprobs" and not self.has_ref) or (name == "value_mask" and not self.has_value_mask):
            return None
        out = np.zeros((B, self.target_width), dtype=np.float32)
        for b, s in enumerate(self.samples):
            values = getattr(s, name)  # Sample's per-token lists are named like the batch's fields
            if len(values) > 1:
                out[b, :len(values) - 1] = values[1:]
        return torch.from_numpy(out)


def collate(samples: Sequence[Sample], pad_id: int) -> TokenBatch:
    """The batch of ``samples`` with every tensor collated now."""
    batch = TokenBatch.from_samples(samples, pad_id)
    for name in _FIELDS:
        getattr(batch, name)
    return batch


def allowed_targets(samples: Sequence[Sample], width: int, k: int | None = None) -> torch.Tensor | None:
    """``Sample.allowed`` of each row on target positions (token t at row t-1), as one (B, width-1, K) tensor
    padded with -1 (``k``: K, else the widest list); None when no sample was constrained."""
    # getattr: a Sample pickled in a checkpoint (SPEAR's replay buffer) before the field existed lacks it
    rows = [getattr(s, "allowed", {}) for s in samples]
    if k is None:
        k = max((len(ids) for allowed in rows for ids in allowed.values()), default=0)
    if not k:
        return None
    out = np.full((len(samples), width - 1, k), -1, dtype=np.int64)
    for b, allowed in enumerate(rows):
        for pos, ids in allowed.items():
            out[b, pos - 1, :len(ids)] = ids
    return torch.from_numpy(out)


def row_blocks(n_rows: int, block: int) -> list[list[int]]:
    """Rows in consecutive blocks of ``block`` that a loss couples (DPO: chosen and rejected of a pair)."""
    if block < 1 or n_rows % block:
        raise ValueError(f"{n_rows} rows do not split into blocks of {block}")
    return [list(range(i, i + block)) for i in range(0, n_rows, block)]


def micro_batches(batch: TokenBatch, token_budget: int, block: int = 1, packed: bool = False) -> list[list[int]]:
    """Split row indices into micro-batches of at most ``token_budget`` padded tokens (rows sorted by
    length so padding stays small); a row longer than the budget gets a micro-batch of its own.
    ``block`` > 1 keeps each block of consecutive rows together, in order (see ``row_blocks``).
    ``packed``: the budget counts real tokens where the rows run concatenated, unpadded (``optim.packing``),
    padded tokens where they would run padded with the batch's shared prompt prefix once (see ``group_rows``)."""
    return group_rows(batch.lengths, token_budget, block, packed, _shared_prefix(batch) if packed else 0)


def _shared_prefix(batch: TokenBatch) -> int:
    """The prompt prefix all of the batch's rows share (read from its samples where it has them: no tensor
    collated)."""
    from agentrl.prefix import shared_prefix_len

    rows = batch.__dict__.get("_rows")
    if rows is not None:
        return shared_prefix_len([s.ids for s in rows.samples])
    return shared_prefix_len([r[:n] for r, n in zip(batch.input_ids.tolist(), batch.lengths)])


def packed_computes_less(real: int, rows: int, widest: int, prefix: int) -> bool:
    """Whether ``rows`` rows of ``real`` tokens in all compute fewer positions packed than padded to the
    ``widest`` with their shared ``prefix`` run once: the one rule for how a micro-batch runs (``hidden.packs``)
    and how the budget counts it (``group_rows``)."""
    return real < prefix + rows * (widest - prefix)


def group_rows(lengths: Sequence[int], token_budget: int, block: int = 1, packed: bool = False,
               prefix: int = 0) -> list[list[int]]:
    """``micro_batches`` from the rows' lengths alone. ``packed``: a micro-batch counts its real tokens, unless
    its rows sharing ``prefix`` leading tokens compute no more positions padded with the prefix run once
    (``agentrl.learner.hidden.packs`` then runs it padded): then, as padded, rows x its widest row, so a
    batch of alike rows is cut as the padded layout cuts it and holds no more than it."""
    blocks = row_blocks(len(lengths), block)
    size = [max(lengths[i] for i in b) for b in blocks]
    real = [sum(lengths[i] for i in b) for b in blocks]
    order = sorted(range(len(blocks)), key=lambda k: size[k])
    out: list[list[int]] = []
    cur: list[int] = []
    width = tokens = 0
    for k in order:
        rows, wide, total = len(cur) + block, max(width, size[k]), tokens + real[k]
        runs_packed = packed and packed_computes_less(total, rows, wide, prefix)
        cost = total if runs_packed else wide * rows
        if cur and cost > token_budget:
            out.append(cur)
            cur, width, tokens = [], 0, 0
        cur += blocks[k]
        width, tokens = max(width, size[k]), tokens + real[k]
    if cur:
        out.append(cur)
    return out


def micro_batch_positions(lengths: Sequence[int], token_budget: int, packed: bool = False, block: int = 1
                          ) -> list[int]:
    """Token positions the decoder computes for each micro-batch of rows of ``lengths`` (grouped as
    ``micro_batches`` groups them): rows x the widest row padded, the rows' real tokens packed (at most: a
    packed micro-batch whose rows share a long prefix runs padded with the prefix once, fewer still). The
    launch plan's activations are those of the largest (``agentrl.gpu_memory.learner``)."""
    return [sum(lengths[i] for i in idx) if packed and len(idx) > 1 else len(idx) * max(lengths[i] for i in idx)
            for idx in group_rows(lengths, token_budget, block, packed)]


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
