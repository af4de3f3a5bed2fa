"""Embedded generator: batched sampling with a transformers model in this process.

Left-padded batch, one prefill, then token-by-token decoding with the KV cache. Finished rows are
dropped from the batch and the cache as they finish, so a batch of ragged turns costs about what its
live rows cost. Each sampled token's log-prob is taken from the same logits it was sampled from.
The prefill runs in chunks of prompt positions (their attention scores within a fixed budget), so a
long prompt costs what its KV cache costs, never a dense L x L score matrix; a prompt that with its
``max_new_tokens`` does not fit the model's context is refused before anything is allocated.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from agentrl.generation import cascade
from agentrl.learner.logprobs import mask_logits, padded_ids, tempered
from agentrl.prefix import shared_prefix_len
from agentrl.schema import ConfigError
from agentrl.types import Completion, SamplingParams, effective_temperature


# Bytes the attention scores of one prefill chunk may take on a CPU (rows x heads x chunk x cache length, fp32;
# on a GPU a quarter of its free memory): the chunk shrinks as prompts grow, so prefill memory stays the KV
# cache plus this
PREFILL_SCORES_BYTES = 256 << 20
UNBOUNDED = 1 << 30  # tokenizers without a limit report ~1e30 as model_max_length


class ContextOverflow(ConfigError):
    """A prompt plus its ``max_new_tokens`` does not fit the model's context (a run stops with its line)."""


def model_context(config: Any, tokenizer: Any = None) -> int | None:
    """The context a transformers model was trained for, in tokens: its config's position limit, lowered by
    the tokenizer's ``model_max_length`` where that is a real limit; None when neither says."""
    n = next((int(v) for k in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
              if (v := getattr(config, k, None))), None)
    t = getattr(tokenizer, "model_max_length", None)
    if isinstance(t, int) and 0 < t < UNBOUNDED:
        n = min(n, t) if n else t
    return n


def sample_from_logits(logits: torch.Tensor, sampling: SamplingParams,
                       gen: torch.Generator | torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (token ids, their log-probs under softmax(logits / T)); top-p only narrows the draw.
    ``gen``: one generator for the batch, or a (rows,) tensor of uniform draws, one per row (each row's
    draw then depends on its own
    stream only, not on the other rows of the batch)."""
    logits = logits.float()
    temperature = effective_temperature(sampling.temperature)
    if temperature <= 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(dim=-1)
        return tok, logp.gather(-1, tok[:, None])[:, 0]
    logp = torch.log_softmax(tempered(logits, temperature), dim=-1)  # the learner's rule: its log-probs are these
    probs = logp.exp()
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < sampling.top_p
        keep[:, 0] = True  # the top token always: a top_p of 1e-300 is 0 in float32 and kept nothing (token 0 drawn)
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    # Inverse-CDF draw: same distribution as torch.multinomial, several times faster on CPU.
    cdf = probs.cumsum(-1)
    if isinstance(gen, torch.Tensor):
        u = gen.to(probs.device)[:, None]
    else:
        u = torch.rand((probs.shape[0], 1), generator=gen, device=probs.device)
    u = u.clamp_min(1e-12) * cdf[:, -1:]
    tok = torch.searchsorted(cdf, u)[:, 0].clamp(max=probs.shape[-1] - 1)
    return tok, logp.gather(-1, tok[:, None])[:, 0]


class ChoiceTrie:
    """Constrained decoding for one row: its answer must be one of ``choices`` (token-id sequences). At each
    step the allowed next ids are those that continue a choice the row's tokens so far are a prefix of;
    the row is done once its tokens equal a whole choice."""

    def __init__(self, choices: list[list[int]]):
        self.live = [list(c) for c in choices if c]
        self.step = 0

    def allowed(self) -> list[int]:
        return sorted({c[self.step] for c in self.live if len(c) > self.step})

    def advance(self, tok: int) -> bool:
        """Take ``tok``; True when the row now holds a whole choice."""
        self.live = [c for c in self.live if len(c) > self.step and c[self.step] == tok]
        self.step += 1
        return any(len(c) == self.step for c in self.live)


def along_choices(target: list[int], choices: list[list[int]] | None) -> list[list[int]] | None:
    """The ids constrained decoding draws each of ``target``'s tokens among: what the learner masks the
    vocabulary to (SFT under ``sft.constrain_actions``, a served completion's ``Completion.allowed``).
    None when ``target`` is not one of ``choices``."""
    if not choices or target not in choices:
        return None
    trie = ChoiceTrie(choices)
    out = []
    for t in target:
        out.append(trie.allowed())
        trie.advance(t)
    return out


def _select_rows(cache: Any, sel: torch.Tensor) -> None:
    """Keep the rows ``sel`` of a static KV cache, in that order (a row may repeat; StaticCache has no
    batch_select_indices)."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[sel], layer.values[sel]
        layer.batch_size = len(sel)


class StagedWeights:
    """A copy of a policy's parameters in host memory, under the names and dtypes of a generator's module
    (tied ones once, as ``named_parameters`` gives them): the engine's ``copy_weights_to`` fills it as it
    would the module."""

    def __init__(self, like: Any, fill: float | None = None):
        self.tensors = {n: torch.empty(t.shape, dtype=t.dtype, device="cpu") for n, t in like.named_parameters()}
        if fill is not None:
            for t in self.tensors.values():
                t.fill_(fill)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def named_parameters(self) -> Any:
        return iter(self.tensors.items())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class EmbeddedGenerator:
    stages = True  # an older version is handed over as a host copy (``stage``, then ``load_weights``)

    def __init__(self, model: Any, tokenizer: Any, stop_ids: list[int], device: str = "cpu"):
        self.model, self.tokenizer, self.stop_ids, self.device = model.eval(), tokenizer, set(stop_ids), device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._staged_once = False  # ``stage`` checks its first copy for parameters the engine did not fill
        self.context = model_context(model.config, tokenizer)
        # in-flight weight updates (``offer``): the version this copy holds, and weights waiting to be loaded
        # before the next forward pass of whatever generation runs (the learner's thread offers, the
        # producer's thread, which runs the generation, loads)
        self.version = 0
        self.inflight = False  # record each token's version in ``Completion.versions``
        self.inflight_loads = 0  # offers loaded so far (the trainer logs the difference per step)
        self._offered: tuple[int, Any] | None = None
        self._offer_lock = threading.Lock()

    @classmethod
    def from_folder(cls, folder: str | Path, dtype: str = "float32", device: str = "cpu") -> "EmbeddedGenerator":
        from agentrl.learner.models import load_model, load_tokenizer, stop_token_ids

        model, tok = load_model(folder, dtype, device), load_tokenizer(folder)
        return cls(model, tok, stop_token_ids(tok, model.config), device)

    def receive(self, engine: Any, staging: Path) -> dict[str, float]:
        """Nothing to do when this generator runs the learner's own module (the torch engine); a copy
        (one per rank under DeepSpeed) is refreshed in memory, collectively."""
        if self.model is not getattr(engine, "model", None):
            self.load_weights(engine)
        return {}

    def stage(self, engine: Any) -> "StagedWeights":
        """A host-memory copy of the engine's weights in this generator's names and dtypes, for a collect
        that starts later (``trainer.max_staleness`` > 1 keeps up to that many; ``load_weights`` takes it).
        Collective under DeepSpeed, like ``receive``."""
        first = not self._staged_once
        staged = StagedWeights(self.model, fill=float("nan") if first else None)
        engine.copy_weights_to(staged)
        if first:  # once per run: every parameter was written (a name the engine does not give stays NaN)
            missed = [n for n, t in staged.tensors.items() if t.isnan().any()]
            if missed:
                raise RuntimeError(f"the learner's weights did not fill the generator's {', '.join(missed[:3])}")
            self._staged_once = True
        return staged

    def offer(self, version: int, weights: "StagedWeights") -> None:
        """In-flight weight updates: ``weights`` (version ``version``, a staged copy) are loaded before the next
        forward pass, of the generation running now or of the next one; a newer offer replaces an unloaded one.
        Rows keep their KV cache: their later tokens are drawn by the new weights over it, and say so."""
        with self._offer_lock:
            if self._offered is None or version > self._offered[0]:
                self._offered = (version, weights)

    def set_version(self, version: int) -> None:
        """The weights now held are version ``version`` (loaded by the caller); an older offer is void."""
        with self._offer_lock:
            self.version = version
            if self._offered is not None and self._offered[0] <= version:
                self._offered = None

    def _take_offer(self) -> None:
        with self._offer_lock:
            got, self._offered = self._offered, None
        if got is not None and got[0] > self.version:
            self.load_weights(got[1])
            self.version = got[0]
            self.inflight_loads += 1

    def release(self) -> bool:
        return False  # holds nothing an update could use

    def context_length(self) -> int | None:
        return self.context

    def set_inflight(self, on: bool) -> None:
        self.inflight = on

    def close(self) -> None:
        pass

    def load_weights(self, source: Any) -> None:
        """An HF folder or a state dict; a learner engine that can hand its weights over in memory
        (``copy_weights_to``) is used directly: under ZeRO-3 that gathers one parameter at a time."""
        if hasattr(source, "copy_weights_to"):
            source.copy_weights_to(self.model)
            return
        if isinstance(source, StagedWeights):
            source = source.tensors
        if isinstance(source, (str, Path)):
            from agentrl.learner.models import load_model

            source = load_model(source, str(next(self.model.parameters()).dtype).replace("torch.", "")).state_dict()
        self.model.load_state_dict(source, strict=False)

    def _stopped_by_string(self, ids: list[int], stops: list[str]) -> bool:
        if not stops:
            return False
        tail = self.tokenizer.decode(ids[-16:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    def _chunk(self, rows: int, cache_len: int) -> int:
        """Prompt positions one prefill call takes: its attention scores (rows x heads x chunk x cache
        length) within ``PREFILL_SCORES_BYTES``."""
        heads = int(getattr(self.model.config, "num_attention_heads", 1) or 1)
        budget = PREFILL_SCORES_BYTES
        if str(self.device).startswith("cuda"):  # fewer, larger chunks: each forward call costs a launch sequence
            budget = max(budget, torch.cuda.mem_get_info(torch.device(self.device))[0] // 4)
        return max(16, budget // (4 * rows * heads * max(1, cache_len)))

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any, start: int) -> Any:
        """Run ``ids`` (rows x width, cache positions ``start``...) into ``cache`` chunk by chunk; ``mask``
        covers every position from 0, ``pos`` the ids' own. Returns the last chunk's output."""
        width, step = ids.shape[1], self._chunk(ids.shape[0], int(cache.get_max_length()))
        out = None
        for a in range(0, width, step):
            b = min(width, a + step)
            # logits_to_keep=1: only the last position's logits are sampled from; the vocabulary projection
            # of every prompt position was a third of the prefill
            out = self.model(input_ids=ids[:, a:b], attention_mask=mask[:, :start + b], position_ids=pos[:, a:b],
                             past_key_values=cache, use_cache=True,
                             cache_position=torch.arange(start + a, start + b, device=ids.device), logits_to_keep=1)
        return out

    def _prefill(self, prompts: list[list[int]], max_new: int
                 ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Fill a static KV cache with the prompts; return (cache, attention mask, positions, last logits, length
        of the shared prefix).

        Rows are laid out as [shared prefix][left padding][own suffix]: the prefix all prompts share (the
        task instructions of a template) is computed once and copied to every row. Padding is masked and
        positions count only real tokens, so each row sees exactly what it would see alone. A static
        cache is written in place (a growing one re-copies all keys and values at every step)."""
        from transformers import StaticCache

        n, dev = len(prompts), self.device
        shared = shared_prefix_len(prompts)
        width = max(len(p) for p in prompts) - shared
        cache = StaticCache(config=self.model.config, max_cache_len=shared + width + max_new)
        if shared:
            pre = torch.tensor([prompts[0][:shared]], device=dev)
            self._forward(pre, torch.ones_like(pre), torch.arange(shared, device=dev)[None], cache, 0)
            for layer in cache.layers:
                layer.keys = layer.keys.expand(n, -1, -1, -1).contiguous()
                layer.values = layer.values.expand(n, -1, -1, -1).contiguous()
                layer.batch_size = n
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, shared + width), dtype=torch.long)
        mask[:, :shared] = 1
        for i, p in enumerate(prompts):
            own = p[shared:]
            ids[i, width - len(own):] = torch.tensor(own)
            mask[i, shared + width - len(own):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self._forward(ids, mask, pos[:, shared:], cache, shared)
        return out.past_key_values, mask, pos, out.logits[:, -1], shared

    def _prefill_rows(self, prompts: list[list[int]], max_new: int, cascaded: bool) -> tuple[Any, Any, Any, Any]:
        """The prompts' cache for decoding and each row's (attention mask, next position, logits). Repeated
        prompts (a GRPO group's) are run once. ``cascaded``: a ``CascadeCache`` whose levels are the prefix
        all prompts share and each distinct prompt's rest, read once a step for all the rows they hold
        (no mask: the levels carry their padding); otherwise the static cache with each prompt's rows copied."""
        distinct: dict[tuple[int, ...], int] = {}
        which = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        sel = torch.tensor(which, device=self.device)
        cache, mask, pos, logits, shared = self._prefill([list(p) for p in distinct], 0 if cascaded else max_new)
        if not cascaded:
            if len(distinct) < len(prompts):
                _select_rows(cache, sel)
            return cache, mask[sel], pos[sel, -1] + 1, logits[sel]
        levels = []

        def part(a: int, b: int, rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            # contiguous: a slice of the static cache's keys is copied by every product over it
            return ([layer.keys[:rows, :, a:b].contiguous() for layer in cache.layers],
                    [layer.values[:rows, :, a:b].contiguous() for layer in cache.layers])

        if shared:
            levels.append(cascade.Level(*part(0, shared, 1), None, torch.zeros_like(sel)))
        valid = mask[:, shared:].bool()
        levels.append(cascade.Level(*part(shared, mask.shape[1], len(distinct)), None if bool(valid.all()) else valid,
                                    sel))
        return cascade.CascadeCache(levels, len(prompts), max_new), None, pos[sel, -1] + 1, logits[sel]

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seeds: list[int] | None = None,
                 choices: list[list[list[int]] | None] | None = None,
                 cancelled: Callable[[], Collection[int]] | None = None) -> list[Completion]:
        """``choices``: per prompt, the token-id sequences its completion must be one of (None: free); each
        token is then drawn from softmax over the ids that continue a choice, and its log-prob is under
        that distribution (``Completion.allowed`` lists those ids).
        ``cancelled``: asked before the prefill and after every decode step for the indices of the prompts
        nobody waits for any more (a server's client hung up); those rows stop there with
        ``finish_reason="cancelled"`` and leave the batch, the others go on exactly as without it."""
        if not prompts:
            return []
        if cancelled is not None and len(set(cancelled())) >= len(prompts):
            return [Completion([], [], "", "cancelled", []) for _ in prompts]
        if choices is not None and len(choices) != len(prompts):
            raise ValueError(f"{len(choices)} choice lists for {len(prompts)} prompts")
        longest = max(len(p) for p in prompts)
        if self.context and longest + sampling.max_new_tokens > self.context:
            raise ContextOverflow(f"a prompt of {longest} tokens + max_new_tokens {sampling.max_new_tokens} does not "
                                  f"fit the model's context of {self.context} tokens")
        tries = [ChoiceTrie(c) if c else None for c in (choices or [None] * len(prompts))]
        if self.model.training:  # the learner's own module is left in train mode (dropout) after a step
            self.model.eval()
        gen: torch.Generator | None = None
        draws: torch.Tensor | None = None  # (rows, max_new_tokens) uniforms, one stream per row
        if seeds is not None:  # per-row streams (CPU generators: the same draws on every device)
            if len(seeds) != len(prompts):
                raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
            draws = torch.stack([torch.rand(sampling.max_new_tokens, generator=torch.Generator().manual_seed(int(s)))
                                 for s in seeds])
        elif sampling.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        self._take_offer()
        drawn_by = self.version  # the version whose forward pass gave ``logits``
        cascaded = cascade.applies(self.model)
        cache, mask, next_pos, logits = self._prefill_rows(prompts, sampling.max_new_tokens, cascaded)
        n = len(prompts)
        rows = list(range(n))  # original index of each live row
        gen_ids: list[list[int]] = [[] for _ in range(n)]
        gen_lp: list[list[float]] = [[] for _ in range(n)]
        gen_allowed: list[list[list[int]]] = [[] for _ in range(n)]
        gen_versions: list[list[int]] = [[] for _ in range(n)]
        finish = ["length"] * n
        for step in range(sampling.max_new_tokens):
            allowed = [tries[r].allowed() if tries[r] is not None else None for r in rows]
            if any(a is not None for a in allowed):
                logits = mask_logits(logits, padded_ids(allowed).to(logits.device))
            tok, lp = sample_from_logits(logits, sampling,
                                         draws[rows, step] if draws is not None else gen)
            keep = []
            toks, lps = tok.tolist(), lp.tolist()  # one read of the device a step, not two a row
            for j, r in enumerate(rows):
                t = toks[j]
                gen_ids[r].append(t)
                gen_lp[r].append(lps[j])
                if self.inflight:
                    gen_versions[r].append(drawn_by)
                whole = False
                if tries[r] is not None:
                    gen_allowed[r].append(allowed[j])
                    whole = tries[r].advance(t)
                if whole or t in self.stop_ids or self._stopped_by_string(gen_ids[r], sampling.stop):
                    finish[r] = "stop"
                else:
                    keep.append(j)
            if cancelled is not None and keep:
                gone = cancelled()
                if gone:
                    for j in keep:
                        if rows[j] in gone:
                            finish[rows[j]] = "cancelled"
                    keep = [j for j in keep if rows[j] not in gone]
            if not keep or step == sampling.max_new_tokens - 1:
                break
            if len(keep) < len(rows):
                sel = torch.tensor(keep, device=self.device)
                tok, next_pos = tok[sel], next_pos[sel]
                if cascaded:
                    cache.keep(sel)
                else:
                    _select_rows(cache, sel)
                    mask = mask[sel]
                rows = [rows[j] for j in keep]
            if self.inflight:
                self._take_offer()
                drawn_by = self.version
            if cascaded:
                out = self.model(input_ids=tok[:, None], position_ids=next_pos[:, None], past_key_values=cache,
                                 use_cache=True, cascade=cache)
                cache.advance()
            else:
                mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=self.device)], dim=1)
                out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                                 past_key_values=cache, use_cache=True,
                                 cache_position=torch.tensor([mask.shape[1] - 1], device=self.device))
            logits = out.logits[:, -1]
            next_pos = next_pos + 1
        return [Completion(gen_ids[i], gen_lp[i], self.tokenizer.decode(gen_ids[i], skip_special_tokens=True),
                           finish[i], gen_allowed[i], gen_versions[i]) for i in range(n)]
