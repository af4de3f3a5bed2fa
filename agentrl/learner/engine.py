"""The torch learner engine: one process, CPU or one GPU.

It implements ``agentrl.learner.protocol.LearnerEngine`` (as ``DeepSpeedEngine`` does): ``logprobs``,
``step`` (gradient accumulation over micro-batches bounded by a token budget, grad clipping, one
optimizer step), ``export_weights`` (an HF folder the generator and vLLM load), ``copy_weights_to``,
``save``/``load`` (model, optimizer, scheduler, step and RNG states, so a resumed run continues
identically). Optional LoRA (peft); for PPO either a separate critic network with its own optimizer
(``agentrl.learner.critic``) or a value head on the policy's last hidden state.
"""
from __future__ import annotations

import contextlib
import json
import random
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from agentrl.checkpoint import export_dtype, load_plain
from agentrl.config import AlgoCfg, ModelCfg, OptimCfg, RecipeCfg, TrainerCfg
from agentrl.learner.batch import TokenBatch, micro_batches
from agentrl.learner.critic import Critic, ValueHead, load_critic  # noqa: F401  (ValueHead: the DeepSpeed engine's)
from agentrl.learner.finite import StepGuard
from agentrl.learner.hidden import batch_prefix_len, decoder_hidden as _decoder_hidden  # noqa: F401  (re-exported)
from agentrl.learner import segments
from agentrl.learner.hidden import pack_index, packed_hidden, packs
from agentrl.learner.logprobs import mask_logits, tempered
from agentrl.learner.models import enable_checkpointing, save_config
from agentrl.learner.projection import target_logprobs
from agentrl.learner.protocol import LossFn


@dataclass
class OptimConfig:
    """The optimizer's settings; the ``optim.*`` keys take their one default from ``agentrl.config.OptimCfg``."""

    lr: float = OptimCfg.lr
    weight_decay: float = OptimCfg.weight_decay
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float | None = OptimCfg.grad_clip
    warmup_steps: int = OptimCfg.warmup_steps


@dataclass
class LoraSettings:
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: Any = "all-linear"


@dataclass
class EngineConfig:
    """What a learner engine is built with. Keys of the recipe config take their one default from
    ``agentrl.config``; ``of`` builds it from a run's config."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraSettings | None = None
    value_head: bool = False  # the estimator needs values: a critic of the kind ``critic`` says
    # "separate": a critic network of its own (its optimizer, lr, checkpoint files); "shared": a value head on
    # the policy's last hidden state (the value loss trains the policy's decoder too)
    critic: str = AlgoCfg.critic
    critic_path: str = AlgoCfg.critic_path  # the critic's starting transformer; empty: the policy's own folder
    critic_lr: float = OptimCfg.critic_lr  # the critic's learning rate; 0: optim.lr
    token_budget: int = OptimCfg.token_budget
    logits_chunk: int = OptimCfg.logits_chunk  # generated positions projected at a time (0: all at once)
    packing: bool = OptimCfg.packing  # micro-batches of rows packed into one, unpadded (optim.packing)
    dtype: str = ModelCfg.dtype
    device: str = "cpu"  # the resolved device (trainer.device's "auto" already decided)
    seed: int = TrainerCfg.seed
    # "bf16": training forward/backward under bf16 autocast (weights, optimizer and rollouts stay in
    # dtype); ~2x the learner's speed on CPUs with AVX512-BF16
    autocast: str = ModelCfg.autocast
    compile: bool = ModelCfg.compile  # torch.compile the decoder (see ModelCfg.compile)
    # recompute layer activations in backward (see ModelCfg.gradient_checkpointing)
    gradient_checkpointing: bool = ModelCfg.gradient_checkpointing
    export_dtype: str = ModelCfg.export_dtype  # a checkpoint's HF folder (see ModelCfg.export_dtype)

    @classmethod
    def of(cls, cfg: RecipeCfg, device: str, value_head: bool) -> EngineConfig:
        """The engine of run config ``cfg`` on ``device`` (with a critic when the estimator needs values)."""
        o, m, a = cfg.optim, cfg.model, cfg.algo
        return cls(optim=OptimConfig(lr=o.lr, weight_decay=o.weight_decay, grad_clip=o.grad_clip,
                                     warmup_steps=o.warmup_steps),
                   lora=LoraSettings(r=m.lora_r, alpha=m.lora_alpha) if m.lora_r else None, value_head=value_head,
                   critic=a.critic, critic_path=a.critic_path, critic_lr=o.critic_lr, token_budget=o.token_budget,
                   logits_chunk=o.logits_chunk, packing=o.packing,
                   dtype=m.dtype, seed=cfg.trainer.seed, device=device, autocast=_autocast(m.autocast, device),
                   compile=m.compile,
                   gradient_checkpointing=m.gradient_checkpointing, export_dtype=m.export_dtype)


def _autocast(spec: str, device: str) -> str:
    """``model.autocast`` as it runs on ``device``: bf16 only where bf16 is native (``native_bf16``); on other
    CPUs it would be several times slower than fp32, so the run trains in fp32 and says so once."""
    from agentrl import dist
    from agentrl.learner.models import native_bf16

    if spec != "bf16" or native_bf16(device):
        return spec
    if dist.is_main():
        print("note: model.autocast=bf16 is not used: this CPU has no bf16 instructions (avx512_bf16, amx_bf16), "
              "where bf16 autocast runs several times slower than fp32; training in fp32", file=sys.stderr, flush=True)
    return ""


def rng_state() -> dict[str, Any]:
    """The process's RNG states as plain tensors, numbers and tuples (checkpoints load with weights_only)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return dict(torch=torch.get_rng_state(), python=random.getstate(),
                numpy=(str(name), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)))


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((name, keys.astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])


def wrap_lora(model: Any, lora: LoraSettings, seed: int) -> Any:
    """``model`` with PEFT LoRA adapters on it (only they train), their random init drawn from ``seed``: both
    engines start from the same adapters, whatever loading the model drew from the RNG (ZeRO-3's does)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                            target_modules=lora.target_modules, task_type="CAUSAL_LM"))


def _decoder_and_head(model: Any) -> tuple[Any, Any] | None:
    """(decoder, lm_head) of a plain HF causal LM (LoRA-wrapped too), or None where the head is not a
    plain projection of the last hidden state (logit soft-capping) or the model hides its parts."""
    get_dec, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    if not (callable(get_dec) and callable(get_head)):
        return None
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return None
    dec, head = get_dec(), get_head()
    return (dec, head) if dec is not None and head is not None and dec is not model else None


def forward_batch(model: Any, value_head: Any, mb: TokenBatch, temperature: float = 1.0, need_entropy: bool = False,
                  need_values: bool = False, targets_only: bool = False, shared_prefix: bool = True,
                  logits_chunk: int = 0, packed: bool = False, logits_chunks: int = 0,
                  prefix_tree: bool = False) -> dict[str, torch.Tensor]:
    """Per-target log-probs (B, T-1), and optionally entropies and values at the same positions.

    ``targets_only``: project to the vocabulary only where ``loss_mask`` is set (other positions read 0).
    Agent turns are mostly prompt (~300 prompt tokens for ~8 generated on Sokoban), and the vocabulary
    projection plus its softmax over every prompt position was a third of the tiny model's step.
    ``shared_prefix``: allow the shared-prefix pass (``_decoder_hidden``); off under ZeRO-3, where every
    rank must call the same modules the same number of times. ``logits_chunk``: project that many generated
    positions at a time (``agentrl.learner.projection``; 0: all at once), in at least ``logits_chunks`` chunks
    (ZeRO-3: as many as every other rank's). ``packed``: run the decoder on the
    rows' real tokens packed into one row (``agentrl.learner.hidden.packed_hidden``), for a model whose
    decoder and head are reachable; the outputs keep the padded (B, T-1) layout. ``prefix_tree``: the padded
    pass also runs what only some rows share once per distinct prefix (``decoder_hidden``; the torch engine)."""
    from agentrl.algos.losses import entropy_from_logits

    pos = (mb.attention_mask.cumsum(-1) - 1).clamp(min=0)  # mb is on the model's device (the engines move it)
    parts = _decoder_and_head(model) if targets_only and mb.loss_mask is not None else None
    if parts is None:
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=pos,
                    output_hidden_states=need_values)
        logits = mask_logits(out.logits[:, :-1].float(), mb.allowed)
        logits = tempered(logits, temperature)
        logp = torch.log_softmax(logits, -1).gather(-1, mb.input_ids[:, 1:, None])[..., 0]
        res = {"logp": logp}
        if need_entropy:
            res["entropy"] = entropy_from_logits(logits)
        if need_values:
            res["values"] = value_head(out.hidden_states[-1][:, :-1])
        return res
    decoder, head = parts
    sel = mb.loss_mask.bool()
    if packed:
        flat = packed_hidden(decoder, mb)  # (L, H)
        index = pack_index(mb.attention_mask)[:, :-1]
        chosen = flat[index[sel]]
    else:
        hidden = _decoder_hidden(decoder, mb, pos, shared_prefix, prefix_tree)
        chosen = hidden[:, :-1][sel]
    picked, entropy = target_logprobs(head, chosen, mb.input_ids[:, 1:][sel],
                                      None if mb.allowed is None else mb.allowed[sel], temperature, need_entropy,
                                      logits_chunk, logits_chunks)
    zeros = torch.zeros(sel.shape, dtype=picked.dtype, device=picked.device)
    res = {"logp": zeros.masked_scatter(sel, picked)}
    if need_entropy:
        res["entropy"] = zeros.masked_scatter(sel, entropy)
    if need_values:
        # packed: the head on each real token once, read back into the padded layout (padding reads 0)
        res["values"] = value_head(flat)[index] * mb.attention_mask[:, 1:] if packed else value_head(hidden[:, :-1])
    return res


class LearnerOutOfMemory(RuntimeError):
    """A micro-batch did not fit on the device; the message names the setting that makes it fit."""


@contextlib.contextmanager
def memory_hint(mb: TokenBatch, token_budget: int, device: str) -> Iterator[None]:
    """Re-raise an out-of-memory error while micro-batch ``mb`` is on the device as one that says what to change."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        rows, width = len(mb), int(mb.attention_mask.sum(1).max())
        fix = (f"set optim.token_budget={max(1, token_budget // 2)} (the same update, in more micro-batches)"
               if rows > 1 else "one row is already too long: shorten the context (rollout.history_len, "
               "rollout.max_turns) or train less of the model (model.lora_r, model.autocast=bf16)")
        raise LearnerOutOfMemory(f"out of {device} memory in a micro-batch of {rows} row{'s' * (rows != 1)} of up "
                                 f"to {width} tokens (optim.token_budget={token_budget}): {fix}. "
                                 f"torch: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


def batched_forward(forward: Callable[..., dict[str, torch.Tensor]], batch: TokenBatch, token_budget: int,
                    temperature: float = 1.0, values: bool = False, device: str = "cpu", packing: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, values) of a whole batch on the CPU, shaped like its target tensors, micro-batch by
    micro-batch on ``device`` (``packing``: the budget counts real tokens, see ``micro_batches``)."""
    logp = torch.zeros(batch.target_shape)  # not ``zeros_like(old_logprobs)``: that collates the whole batch
    vals = torch.zeros(batch.target_shape)
    for idx in micro_batches(batch, token_budget, packed=packing):
        part = batch.select(idx)
        with memory_hint(part, token_budget, device):
            out = forward(part.to(device), temperature, need_values=values)
        w = out["logp"].shape[1]
        logp[idx, :w] = out["logp"].float().cpu()
        if "values" in out:
            vals[idx, :w] = out["values"].float().cpu()
    return logp, vals


class FrozenReference:
    """The frozen reference policy that KL terms measure against: a copy of some weights held in memory,
    evaluated without gradient (the torch engine's; DeepSpeed's is a ZeRO-3 engine of its own)."""

    def __init__(self, folder: str | Path, dtype: str, device: str, token_budget: int, logits_chunk: int = 0,
                 packing: bool = False):
        from agentrl.learner.models import load_model

        self.folder, self.device, self.token_budget = Path(folder), device, token_budget
        self.logits_chunk, self.packing = logits_chunk, packing
        self.model = load_model(folder, dtype, device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch, temperature: float = 1.0) -> torch.Tensor:
        def fwd(mb: TokenBatch, t: float, need_values: bool = False) -> dict[str, torch.Tensor]:
            return forward_batch(self.model, None, mb, t, targets_only=True, logits_chunk=self.logits_chunk,
                                 packed=packs(mb, self.packing, True), prefix_tree=True)

        return batched_forward(fwd, batch, self.token_budget, temperature, False, self.device, self.packing)[0]


class TorchEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        from agentrl.learner.models import load_model, load_tokenizer

        self.cfg = config or EngineConfig()
        self.device = self.cfg.device
        torch.manual_seed(self.cfg.seed)
        self.model_dir = Path(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_model(model_dir, self.cfg.dtype, self.cfg.device)
        self.cfg = replace(self.cfg, packing=segments.packing_for(self.model, self.cfg.packing))
        if self.cfg.gradient_checkpointing:  # before LoRA: peft wraps the model with its layers' flags set
            enable_checkpointing(self.model)
        if self.cfg.lora is not None:
            self.model = wrap_lora(self.model, self.cfg.lora, self.cfg.seed)
        if self.cfg.compile:
            self._compile_decoder()
        separate = self.cfg.value_head and self.cfg.critic == "separate"
        self.value_head = ValueHead(self.model.config.hidden_size).to(self.cfg.device) \
            if self.cfg.value_head and not separate else None
        self.critic: Critic | None = None
        self.critic_optimizer: Any = None
        if separate:
            self.critic = load_critic(self.cfg.critic_path or model_dir, self.cfg.dtype, self.cfg.device)
            if self.cfg.gradient_checkpointing:
                enable_checkpointing(self.critic.backbone)
            self.critic_optimizer = critic_optimizer(self.critic, self.cfg.optim, self.cfg.critic_lr)
            self._critic_guard = StepGuard(_OptimizerOf(self.critic_optimizer))  # a NaN gradient is not applied
        self.optimizer = torch.optim.AdamW(self.policy_parameters(), lr=self.cfg.optim.lr,
                                           betas=self.cfg.optim.betas, eps=self.cfg.optim.eps,
                                           weight_decay=self.cfg.optim.weight_decay)
        warm = max(0, self.cfg.optim.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        self.global_step = 0
        self.reference: Any = None  # set_reference: a FrozenReference, or "adapters-off" (LoRA)

    def _compile_decoder(self) -> None:
        """Compile the decoder in place (its parameters, LoRA's included, stay the ones the optimizer and
        checkpoints see). Shapes change every batch, hence dynamic; the head and losses stay eager. A
        model that hides its decoder is called whole (``forward_batch``), so it is compiled whole."""
        parts = _decoder_and_head(self.model)
        (parts[0] if parts is not None else self.model).compile(dynamic=True)

    def policy_parameters(self) -> list[torch.nn.Parameter]:
        """What the policy's optimizer steps: the policy (LoRA: its adapters) and a shared value head."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.value_head is not None:
            params += list(self.value_head.parameters())
        return params

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Every weight the engine trains: the policy's and a separate critic's."""
        return self.policy_parameters() + (list(self.critic.parameters()) if self.critic is not None else [])

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    # ----- compute -----------------------------------------------------------------------------
    def forward(self, mb: TokenBatch, temperature: float = 1.0, need_entropy: bool = False,
                need_values: bool = False) -> dict[str, torch.Tensor]:
        packed = packs(mb, self.cfg.packing, True)  # or the padded pass with its shared prefix run once
        out = forward_batch(self.model, self.value_head, mb, temperature, need_entropy,
                            need_values and self.critic is None, targets_only=True,
                            logits_chunk=self.cfg.logits_chunk, packed=packed, prefix_tree=True)
        if need_values and self.critic is not None:
            out["values"] = self.critic(mb, packed=packed, prefix_tree=True)
        return out

    @property
    def has_values(self) -> bool:
        return self.value_head is not None or self.critic is not None

    def _train_mode(self, on: bool) -> None:
        self.model.train(on)
        if self.critic is not None:
            self.critic.train(on)

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch, temperature: float = 1.0, values: bool = False
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Log-probs (and values) for the whole batch, computed micro-batch by micro-batch."""
        self._train_mode(False)
        logp, vals = batched_forward(self.forward, batch, self.cfg.token_budget, temperature,
                                     values and self.has_values, self.device, self.cfg.packing)
        return (logp, vals) if values else logp

    def set_reference(self, folder: str | Path | None) -> None:
        """Freeze the reference policy: the weights in ``folder`` (a copy in memory), or with LoRA and no
        folder, this model with its adapters disabled (the base model, no copy)."""
        if folder is None:
            if self.cfg.lora is None:
                raise ValueError("a reference policy without a weights folder needs LoRA (the base model with "
                                 "its adapters disabled)")
            self.reference = "adapters-off"
            return
        self.reference = FrozenReference(folder, self.cfg.dtype, self.device, self.cfg.token_budget,
                                         self.cfg.logits_chunk, self.cfg.packing)

    @torch.no_grad()
    def ref_logprobs(self, batch: TokenBatch, temperature: float = 1.0) -> torch.Tensor:
        """The reference policy's per-target log-probs of the whole batch (B, T-1), on the CPU."""
        if self.reference is None:
            raise RuntimeError("no reference policy: a KL term needs set_reference() first")
        if self.reference == "adapters-off":
            self.model.eval()
            with self.model.disable_adapter():
                return batched_forward(self.forward, batch, self.cfg.token_budget, temperature, False, self.device,
                                       self.cfg.packing)[0]
        return self.reference.logprobs(batch, temperature)

    def step(self, batch: TokenBatch, loss_fn: LossFn, temperature: float = 1.0, need_entropy: bool = False,
             need_values: bool = False, weight_by: str = "tokens", row_block: int = 1) -> dict[str, float]:
        """One optimizer step on ``batch`` (see ``backward``), then clipping and the update."""
        self._train_mode(True)
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic_optimizer is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)
        stats = self.backward(batch, loss_fn, temperature, need_entropy, need_values, weight_by, row_block)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the step's own; the scheduler then sets the next
        stats.update(grad_norm=self._clip_and_step(), lr=lr)
        if self.critic_optimizer is not None:
            stats["critic_grad_norm"] = self._critic_step()
        return stats

    @torch.no_grad()
    def critic_from_policy(self) -> None:
        """The separate critic's transformer takes the policy's weights now (after SFT: the critic starts from
        the policy RL starts from); its value head and optimizer start over."""
        if self.critic is None:
            return
        decoder = self.merged_model().get_decoder()
        self.critic.backbone.load_state_dict(decoder.state_dict())
        for p in self.critic.head.parameters():
            p.zero_()
        self.critic_optimizer = critic_optimizer(self.critic, self.cfg.optim, self.cfg.critic_lr)
        self._critic_guard = StepGuard(_OptimizerOf(self.critic_optimizer))

    def _critic_step(self) -> float:
        """The separate critic's own clipping and update. One backward filled both networks' gradients:
        the value loss reaches only the critic, the policy loss only the policy."""
        clip = self.cfg.optim.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(list(self.critic.parameters()), clip if clip else float("inf"))
        self.critic_optimizer.step()
        return float(norm)

    def backward(self, batch: TokenBatch, loss_fn: LossFn, temperature: float = 1.0, need_entropy: bool = False,
                 need_values: bool = False, weight_by: str = "tokens", row_block: int = 1) -> dict[str, float]:
        """Accumulate gradients over micro-batches. Each micro-batch's loss is weighted by its share of
        the batch's target tokens (token-mean losses) or sequences (sequence-mean losses), so the
        accumulated gradient equals that of one big batch. ``row_block``: consecutive rows a loss couples
        stay in one micro-batch (DPO's pairs)."""
        parts = micro_batches(batch, self.cfg.token_budget, row_block, self.cfg.packing)
        total = batch.num_targets if weight_by == "tokens" else len(batch)
        stats: dict[str, float] = {}
        loss_sum = 0.0
        for idx in parts:
            part = batch.select(idx)
            with memory_hint(part, self.cfg.token_budget, self.device):
                mb = part.to(self.device)
                w = (mb.num_targets if weight_by == "tokens" else len(idx)) / max(1, total)
                with torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16,
                                    enabled=self.cfg.autocast == "bf16"):
                    out = self.forward(mb, temperature, need_entropy, need_values)
                loss, s = loss_fn(mb, out)
                self._backward(loss * w)
            loss_sum += float(loss.detach()) * w
            for k, v in s.items():
                stats[k] = stats.get(k, 0.0) + v * w
        stats.update(loss=loss_sum, micro_batches=len(parts))
        return stats

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _clip_and_step(self) -> float:
        params = self.policy_parameters()
        clip = self.cfg.optim.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.global_step += 1
        return float(norm)

    # ----- weights out -------------------------------------------------------------------------
    def merged_model(self) -> Any:
        """The policy as a plain transformers model (LoRA merged into a copy)."""
        if self.cfg.lora is None:
            return self.model
        import copy

        return copy.deepcopy(self.model).merge_and_unload()

    def export_weights(self, folder: str | Path, dtype: str | None = None) -> Path:
        folder = Path(folder)
        model = self.merged_model()
        state = None if dtype in (None, self.cfg.dtype) else {
            k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in model.state_dict().items()}
        model.save_pretrained(folder, safe_serialization=True, state_dict=state)
        if state is not None:
            save_config(model, folder, dtype)
        self.tokenizer.save_pretrained(folder)
        return folder

    def export_adapter(self, folder: str | Path) -> Path:
        if self.cfg.lora is None:
            raise ValueError("export_adapter needs a LoRA engine")
        self.model.save_pretrained(folder)
        return Path(folder)

    @torch.no_grad()
    def copy_weights_to(self, model: Any) -> None:
        """Copy the policy (LoRA merged) into ``model``, a plain module of the same architecture."""
        src = self.merged_model().state_dict()
        for name, p in model.state_dict().items():
            if name in src:
                p.copy_(src[name].to(p.device, p.dtype))

    @torch.no_grad()
    def iter_weights(self, every_rank: bool = False) -> Iterator[tuple[str, torch.Tensor | None]]:
        for name, p in self.merged_model().named_parameters():
            yield name, p.detach()

    def close(self) -> None:
        pass

    # ----- checkpoints -------------------------------------------------------------------------
    def _trainable_names(self) -> set[str]:
        return {n for n, p in self.model.named_parameters() if p.requires_grad}

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.export_weights(folder / "model", export_dtype("torch", self.cfg))  # transformers and vLLM load it as is
        model_state = self.model.state_dict()
        if self.cfg.lora is not None:  # the frozen base is the model folder the engine is built on: adapters only
            trainable = self._trainable_names()
            model_state = {k: v for k, v in model_state.items() if k in trainable}
        state = dict(model=model_state, optimizer=self.optimizer.state_dict(),
                     scheduler=self.scheduler.state_dict(), rng=rng_state(),
                     value_head=self.value_head.state_dict() if self.value_head is not None else None)
        torch.save(state, folder / "engine.pt")
        if self.critic is not None:  # inside the step folder: the checkpoint's manifest covers it
            torch.save(dict(model=self.critic.state_dict(), optimizer=self.critic_optimizer.state_dict()),
                       folder / "critic.pt")
        (folder / "engine.json").write_text(json.dumps(dict(global_step=self.global_step,
                                                            config=asdict(self.cfg)), default=str))
        return folder

    def load(self, folder: str | Path) -> None:
        folder = Path(folder)
        if self.critic is not None and not (folder / "critic.pt").is_file():
            raise ValueError(f"{folder} holds no critic.pt: it was saved without a separate critic "
                             "(algo.critic=shared); resume with algo.critic=shared")
        state = load_plain(folder / "engine.pt")  # tensors and containers only: a tampered file runs no code
        if self.cfg.lora is None:
            self.model.load_state_dict(state["model"])
        else:  # the adapters (a checkpoint of older runs holds the base too, the same weights)
            missing = self._trainable_names() - set(state["model"])
            if missing:
                raise ValueError(f"{folder / 'engine.pt'} lacks adapter weights this LoRA engine trains (e.g. "
                                 f"{sorted(missing)[0]}): it was saved with another model.lora_* setting")
            self.model.load_state_dict(state["model"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.value_head is not None and state.get("value_head") is not None:
            self.value_head.load_state_dict(state["value_head"])
        if self.critic is not None:
            self._load_critic(folder / "critic.pt")
        set_rng_state(state["rng"])
        self.global_step = json.loads((folder / "engine.json").read_text())["global_step"]

    def _load_critic(self, path: Path) -> None:
        state = load_plain(path)
        self.critic.load_state_dict(state["model"])
        self.critic_optimizer.load_state_dict(state["optimizer"])


class _OptimizerOf:
    """What ``StepGuard`` reads an engine's optimizer from, for the critic's own optimizer."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer


def critic_optimizer(critic: Critic, optim: OptimConfig, critic_lr: float) -> torch.optim.Optimizer:
    """AdamW over the critic's weights at its own learning rate (0: the policy's); the policy's settings
    otherwise. Its lr stays constant: the RL lr schedule steers the policy."""
    return torch.optim.AdamW(list(critic.parameters()), lr=critic_lr or optim.lr, betas=optim.betas, eps=optim.eps,
                             weight_decay=optim.weight_decay)
