"""DeepSpeed ZeRO-3 learner engine, implementing ``agentrl.learner.protocol.LearnerEngine``.

Launch with ``deepspeed`` or ``torchrun`` on GPU nodes (NCCL); on CPU it runs for real with gloo
(``DS_ACCELERATOR=cpu``), which is how the test suite covers it. Every rank is handed the same global
batch and trains on its share (row blocks dealt by tokens; a batch from ``TokenBatch.from_samples`` collates
only that share's tensors on the rank); losses are weighted so the averaged
gradient equals that of the whole batch; the passes without gradient (the KL reference's, a ZeRO-3
engine of its own, too) run each rank's rows only. A torch AdamW is handed to DeepSpeed (no cpu_adam build
needed); ``export_weights`` gathers the sharded parameters and rank 0 writes an HF folder;
``copy_weights_to`` gathers one parameter at a time into each rank's generator copy. A separate critic
(``EngineConfig.critic="separate"``) is a DeepSpeed engine of its own: its weights and optimizer sharded
over the ranks like the policy's, its own lr, saved beside the policy's in the checkpoint.

LoRA (``EngineConfig.lora``) follows PEFT's ZeRO-3 path: the adapters are added to the model loaded
sharded, before ``deepspeed.initialize`` (which shards them too); only they train, so the optimizer and its
checkpoint shards hold the adapters alone (the frozen base is rebuilt from the model folder). The weights
handed out (``iter_weights``, ``copy_weights_to``, ``export_weights``) are the base's, each merged with its
adapter as it is gathered; ``export_adapter`` writes the adapters for vLLM from a copy rank 0 gathers after
each update; the KL reference without a folder is this model with its adapters off.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import torch

from agentrl.checkpoint import export_dtype, load_plain
from agentrl.learner.batch import TokenBatch, deal_rows, micro_batches, stand_in_rows
from agentrl.learner.critic import load_critic
from agentrl.learner.engine import (EngineConfig, ValueHead, _OptimizerOf, batch_prefix_len, critic_optimizer,
                                    forward_batch, memory_hint, rng_state, set_rng_state, wrap_lora)
from agentrl.learner.finite import StepGuard
from agentrl.learner import segments
from agentrl.learner.hidden import packs
from agentrl.learner.models import save_config
from agentrl.learner.projection import chunk_count
from agentrl.learner.protocol import LossFn

ZERO3 = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                          "stage3_gather_16bit_weights_on_model_save": False},
    "zero_allow_untested_optimizer": True,
    "gradient_clipping": 1.0,
    "fp16": {"enabled": False},
    "bf16": {"enabled": False},
    "wall_clock_breakdown": False,
}


EXPORT_SHARD_MB = 2048  # the most rank 0 holds of an export at once (plus one parameter)


class DeepSpeedConfigError(ValueError):
    pass


def load_ds_config(spec: str | Path | dict | None) -> dict[str, Any]:
    """The DeepSpeed JSON (default: ZeRO-3 on fp32), checked for what this engine supports; raises
    ``DeepSpeedConfigError`` naming the file and the key otherwise."""
    if spec is None or spec == "":
        return json.loads(json.dumps(ZERO3))
    where = "deepspeed config"
    if isinstance(spec, dict):
        ds = json.loads(json.dumps(spec))
    else:
        where = str(spec)
        path = Path(spec)
        if not path.is_file():
            raise DeepSpeedConfigError(f"trainer.deepspeed_config: {spec} is not a file (shipped: configs/deepspeed/"
                                       "zero3.json, configs/deepspeed/zero3_offload.json)")
        try:
            ds = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DeepSpeedConfigError(f"{spec}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(ds, dict):
        raise DeepSpeedConfigError(f"{where}: must be a JSON object")
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise DeepSpeedConfigError(f"{where}: '{key}' is not supported: the engine builds its own AdamW from "
                                       "optim.* (lr, weight_decay, grad_clip); remove the section")
    if (ds.get("fp16") or {}).get("enabled"):
        raise DeepSpeedConfigError(f"{where}: 'fp16.enabled' is not supported (no loss scaling in the RL losses); "
                                   "use bf16 or fp32")
    zero = ds.get("zero_optimization") or {}
    if not isinstance(zero, dict) or zero.get("stage", 0) != 3:
        raise DeepSpeedConfigError(f"{where}: 'zero_optimization.stage' must be 3 (the engine shards and gathers "
                                   f"ZeRO-3 parameters), got {zero.get('stage') if isinstance(zero, dict) else zero!r}")
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if ds.get(key, 1) != 1:
            raise DeepSpeedConfigError(f"{where}: '{key}' must be 1: micro-batching follows optim.token_budget and "
                                       "one step() is one optimizer step")
    if zero.get("offload_optimizer"):
        ds.setdefault("zero_force_ds_cpu_optimizer", False)  # offload with the engine's torch AdamW
    ds.pop("train_batch_size", None)  # derived by DeepSpeed from the two keys above and the world size
    return ds


def reference_ds_config(ds: dict[str, Any]) -> dict[str, Any]:
    """The policy's DeepSpeed config for a frozen model (the KL reference): its parameters sharded, offloaded
    and in the dtype the policy's are, without the optimizer's sections (it has none)."""
    ref = json.loads(json.dumps(ds))
    ref.setdefault("zero_optimization", {}).pop("offload_optimizer", None)
    for key in ("zero_force_ds_cpu_optimizer", "gradient_clipping"):
        ref.pop(key, None)
    ref["bf16"] = dict(ref.get("bf16") or {}, enabled=bool((ref.get("bf16") or {}).get("enabled")))
    return ref


def _load_ds_file(path: str, map_location: Any = None) -> Any:
    """A DeepSpeed checkpoint file, loaded with ``weights_only`` (the ZeRO stage enum and loss scaler
    allowed, plain classes of DeepSpeed's): a tampered file is refused, not run."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return load_plain(path, map_location=map_location, safe_globals=(ZeroStageEnum, LossScaler))


def saved_world(tag_dir: Path) -> int:
    """The number of ranks that wrote a ZeRO-3 checkpoint: one optimizer shard file each."""
    return len(list(Path(tag_dir).glob("zero_pp_rank_*_mp_rank_00_optim_states.pt")))


def to_universal(tag_dir: Path, out: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` in this process: ``tag_dir`` (one ZeRO checkpoint, any number of ranks)
    as a universal checkpoint in ``out`` (``out.parent`` gets its ``latest_universal``)."""
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    shutil.rmtree(out.parent, ignore_errors=True)  # a conversion killed half-way: this engine's own folder
    out.parent.mkdir(parents=True)
    ds_to_universal.main(argparse.Namespace(input_folder=str(tag_dir), output_folder=str(out), num_extract_workers=1,
                                            num_merge_workers=1, keep_temp_folder=False, strict=True,
                                            inject_missing_state=False))


def bf16_enabled(ds: dict[str, Any]) -> bool:
    """The DeepSpeed config trains in mixed precision: bf16 parameters and gradients, fp32 master weights and
    Adam moments in the optimizer."""
    return bool((ds.get("bf16") or {}).get("enabled"))


def weights_dtype(ds: dict[str, Any], dtype: str) -> str:
    """The dtype the engine's parameter shards are built in: bfloat16 when the DeepSpeed config enables bf16
    (whatever model.dtype says: DeepSpeed casts a model handed to it whole, but leaves a model built under
    ``zero.Init`` as it was made), else ``dtype`` (model.dtype)."""
    return "bfloat16" if bf16_enabled(ds) else dtype


@contextlib.contextmanager
def sharded_loading(ds: dict[str, Any], dtype: str) -> Iterator[None]:
    """``from_pretrained`` inside the block builds each parameter partitioned (``zero.Init``, through
    transformers' DeepSpeed integration, which reads this config while an ``HfDeepSpeedConfig`` lives) and
    loads the checkpoint layer by layer into the shards: no rank ever holds the whole model. Parameters
    are made in ``dtype`` (``weights_dtype``: the engine's). Unset after: the reference and the generator's
    copies loaded later are whole models."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    hf = json.loads(json.dumps(ds))
    hf["bf16"] = {"enabled": dtype == "bfloat16"}  # zero.Init makes its shards in the dtype this names
    hf["fp16"] = {"enabled": False}
    keep = HfDeepSpeedConfig(hf)  # noqa: F841 - transformers holds only a weak reference: keep it alive here
    try:
        yield
    finally:
        unset_hf_deepspeed_config()


def skip_cpu_shm_build() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce on init, used only by its inference
    path. A process killed mid-build leaves torch's lock file behind and every later init waits on it
    forever, so training on CPU skips the build (gloo does the all-reduce)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


class DeepSpeedEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None,
                 ds_config: str | Path | dict | None = None):
        import deepspeed
        import torch.distributed as dist

        from agentrl.learner.models import enable_checkpointing, load_model, load_tokenizer

        self.cfg = config or EngineConfig()
        self.device = self.cfg.device
        ds = load_ds_config(ds_config)  # before any collective: a bad file is one error on every rank
        if self.cfg.compile:
            raise NotImplementedError("model.compile under trainer.engine=deepspeed is not supported (ZeRO-3 gathers "
                                      "parameters in hooks around each module); use trainer.engine=torch to compile")
        if self.cfg.device == "cpu":
            skip_cpu_shm_build()
        if not dist.is_initialized():
            if "RANK" not in os.environ:  # one process without a launcher: a group of one on loopback
                from agentrl.launch import free_port

                os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
            backend = "gloo" if self.cfg.device == "cpu" else "nccl"
            deepspeed.init_distributed(dist_backend=backend)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(self.cfg.seed)
        if self.cfg.optim.grad_clip is not None:
            ds["gradient_clipping"] = self.cfg.optim.grad_clip
        else:
            ds.pop("gradient_clipping", None)
        self.tokenizer = load_tokenizer(model_dir)
        # the policy's and the critic's shards in the DeepSpeed config's precision (bf16: its optimizer keeps
        # the fp32 master weights and Adam's moments)
        self.dtype = weights_dtype(ds, self.cfg.dtype)
        with sharded_loading(ds, self.dtype):  # each rank builds and keeps only its shard of the weights
            model = load_model(model_dir, self.dtype, "cpu")
            separate = self.cfg.value_head and self.cfg.critic == "separate"
            critic = load_critic(self.cfg.critic_path or model_dir, self.dtype, "cpu") if separate else None
        self.cfg = replace(self.cfg, packing=segments.packing_for(model, self.cfg.packing))
        if self.cfg.gradient_checkpointing:
            enable_checkpointing(model)
        if self.cfg.lora is not None:  # made whole, outside zero.Init: deepspeed.initialize shards them
            model = wrap_lora(model, self.cfg.lora, self.cfg.seed)
            for p in model.parameters():  # peft keeps them fp32; DeepSpeed casts no parameter of a zero.Init model
                if p.requires_grad:
                    p.data = p.data.to(getattr(torch, self.dtype))
        # made outside zero.Init, the shared value head is partitioned by DeepSpeed as it is: in the shards' dtype
        self.value_head = ValueHead(model.config.hidden_size).to(getattr(torch, self.dtype)) \
            if self.cfg.value_head and not separate else None
        module = _WithValueHead(model, self.value_head, self.cfg.logits_chunk)
        params = [p for p in module.parameters() if p.requires_grad]
        opt = self.cfg.optim
        optimizer = torch.optim.AdamW(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
        warm = max(0, opt.warmup_steps)
        # The same warm-up as the torch engine, stepped by DeepSpeed with the optimizer; ``set_lr`` moves its
        # base lrs (``agentrl.learner.lr``), and DeepSpeed checkpoints its state.
        schedule = lambda o: torch.optim.lr_scheduler.LambdaLR(  # noqa: E731
            o, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module, optimizer=optimizer, config=ds, model_parameters=params, lr_scheduler=schedule)
        self.critic_ds: Any = None
        self.critic_optimizer: Any = None
        if critic is not None:  # its own engine: sharded, clipped and stepped apart from the policy
            critic.head.to(getattr(torch, self.dtype))  # made outside zero.Init, like the shared head above
            if self.cfg.gradient_checkpointing:
                enable_checkpointing(critic.backbone)
            copt = critic_optimizer(critic, opt, self.cfg.critic_lr)
            self.critic_ds, self.critic_optimizer, _, _ = deepspeed.initialize(
                model=critic, optimizer=copt, config=json.loads(json.dumps(ds)),
                model_parameters=list(critic.parameters()))
            self._critic_guard = StepGuard(_OptimizerOf(self.critic_optimizer))  # a NaN gradient is not applied
        self.global_step = 0
        self.reference: Any = None  # set_reference: a ZeRO-3 engine, or "adapters-off" (LoRA)
        self._adapter: dict[str, torch.Tensor] | None = None  # rank 0's copy of the adapters (LoRA)
        self._gather_adapter()

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def local_rows(self, batch: TokenBatch, row_block: int = 1) -> list[int]:
        """This rank's rows, dealt by tokens (``deal_rows``: a block is never split across ranks)."""
        return deal_rows(batch.lengths, self.world, row_block)[self.rank]

    def _plan(self, batch: TokenBatch, row_block: int = 1
              ) -> tuple[list[int], list[list[int]], list[TokenBatch], list[bool], list[int]]:
        """Collective. This rank's rows, its micro-batches (indices into its rows), the batches it runs and,
        for each, whether it may take the shared-prefix pass and the vocabulary chunks it projects in
        (``optim.logits_chunk``: each chunk calls the LM head, whose weights ZeRO-3 gathers at each call, so
        every rank runs the most chunks any rank's k-th micro-batch needs). Ranks must run the same number of collective
        passes: a rank with fewer micro-batches (or no rows) runs the missing ones on the batch's shortest
        row block (``stand_in_rows``), whose outputs count for nothing. The shared-prefix pass calls the
        decoder twice and ZeRO-3 ranks must gather the same layers in step, so micro-batch k takes it only
        where every rank's k-th does."""
        import torch.distributed as dist

        rows = self.local_rows(batch, row_block)
        # a batch from ``TokenBatch.from_samples`` collates nothing here: each micro-batch's tensors (this rank's
        # rows only) are built when the pass reads them
        local = batch.select(rows) if rows else None
        parts = micro_batches(local, self.cfg.token_budget, row_block, self.cfg.packing) if local is not None else []
        n_parts = torch.tensor([len(parts)], device=self.device)
        dist.all_reduce(n_parts, op=dist.ReduceOp.MAX)
        stand_in = batch.select(stand_in_rows(batch.lengths, row_block))
        mbs = [(local.select(parts[k]) if k < len(parts) else stand_in) for k in range(int(n_parts))]
        # packing: a rank whose k-th micro-batch computes fewer positions packed declines the prefix pass for
        # all; where every rank takes it, none packs (``packs`` reads the same), else each packs its own
        has_prefix = torch.tensor([int(batch_prefix_len(m.input_ids, m.attention_mask) > 0
                                       and not packs(m, self.cfg.packing, True)) for m in mbs], device=self.device)
        dist.all_reduce(has_prefix, op=dist.ReduceOp.MIN)
        chunks = [0] * len(mbs)
        if self.cfg.logits_chunk > 0:
            counts = torch.tensor([chunk_count(int(m.loss_mask.bool().sum()), self.cfg.logits_chunk) for m in mbs],
                                  device=self.device)
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
            chunks = [int(x) for x in counts.tolist()]
        return rows, parts, mbs, [bool(x) for x in has_prefix.tolist()], chunks

    def _own_rows_forward(self, forward: Any, batch: TokenBatch, temperature: float, values: bool
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective, no gradient: (log-probs, values) of the whole batch shaped like its targets, each rank
        running only its own rows; the rows are disjoint, so a sum over ranks all-gathers them exactly."""
        import torch.distributed as dist

        rows, parts, mbs, has_prefix, chunks = self._plan(batch)
        logp = torch.zeros(batch.target_shape, device=self.device)  # the whole batch's shape, no tensor of it read
        vals = torch.zeros(batch.target_shape, device=self.device)
        for k, mb in enumerate(mbs):
            with memory_hint(mb, self.cfg.token_budget, self.device):
                out = forward(mb.to(self.device), temperature, need_values=values, shared_prefix=has_prefix[k],
                              chunks=chunks[k])
            if k < len(parts):
                idx = torch.tensor([rows[i] for i in parts[k]], device=self.device)
                w = out["logp"].shape[1]
                logp[idx, :w] = out["logp"].float()
                if "values" in out:
                    vals[idx, :w] = out["values"].float()
        both = torch.stack([logp, vals])
        dist.all_reduce(both)
        return both[0].cpu(), both[1].cpu()

    def partition_numel(self) -> int:
        """Parameter elements this rank holds (ZeRO-3 shards parameters across ranks)."""
        return sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in self.ds.module.parameters())

    def full_numel(self) -> int:
        return sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in self.ds.module.parameters())

    def forward(self, mb: TokenBatch, temperature: float = 1.0, need_entropy: bool = False,
                need_values: bool = False, shared_prefix: bool = True, chunks: int = 0) -> dict[str, torch.Tensor]:
        """Collective under ZeRO-3. ``shared_prefix`` and ``chunks`` (the vocabulary chunks to run at least)
        must be the same on every rank (``_plan`` agrees on both). Packed or padded is each rank's own choice:
        either calls the decoder once."""
        packed = packs(mb, self.cfg.packing, shared_prefix)
        out = self.ds(mb, temperature=temperature, need_entropy=need_entropy,
                      need_values=need_values and self.critic_ds is None, shared_prefix=shared_prefix, packed=packed,
                      logits_chunks=chunks)
        if need_values and self.critic_ds is not None:
            out["values"] = self.critic_ds(mb, shared_prefix=shared_prefix, packed=packed)
        return out

    def _train_mode(self, on: bool) -> None:
        self.ds.train(on)
        if self.critic_ds is not None:
            self.critic_ds.train(on)

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch, temperature: float = 1.0, values: bool = False
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Collective: each rank computes its own rows, and every rank gets the whole batch's numbers."""
        self._train_mode(False)
        logp, vals = self._own_rows_forward(self.forward, batch, temperature,
                                            values and (self.value_head is not None or self.critic_ds is not None))
        return (logp, vals) if values else logp

    def set_reference(self, folder: str | Path | None) -> None:
        """Collective. Freeze the reference policy: the weights in ``folder`` as a ZeRO-3 engine without an
        optimizer, loaded and sharded over the ranks like the policy (``zero.Init``: no rank holds it whole;
        offloaded where the policy's parameters are), in the training dtype (bf16 when the DeepSpeed config
        enables it). LoRA and ``None``: this model with its adapters disabled."""
        import deepspeed

        from agentrl.learner.models import load_model

        if folder is None:
            if self.cfg.lora is None:
                raise ValueError("a reference policy without a weights folder needs LoRA (the base model with "
                                 "its adapters disabled)")
            self.reference = "adapters-off"  # no copy: the sharded base with the adapters skipped
            return
        ds = reference_ds_config(self.ds.config)
        dtype = weights_dtype(ds, self.cfg.dtype)
        with sharded_loading(ds, dtype):  # like the policy: each rank builds and keeps only its shard
            model = load_model(folder, dtype, "cpu").eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.reference, *_ = deepspeed.initialize(model=_WithValueHead(model, None, self.cfg.logits_chunk), config=ds)
        self.reference.eval()

    @torch.no_grad()
    def ref_logprobs(self, batch: TokenBatch, temperature: float = 1.0) -> torch.Tensor:
        """Collective: each rank runs its own rows through the sharded reference; every rank gets them all."""
        if self.reference is None:
            raise RuntimeError("no reference policy: a KL term needs set_reference() first")
        if self.reference == "adapters-off":
            self._train_mode(False)
            with self.ds.module.policy.disable_adapter():  # every rank: the same modules skipped, in step
                return self._own_rows_forward(self.forward, batch, temperature, False)[0]

        def forward(mb: TokenBatch, t: float, need_values: bool = False, shared_prefix: bool = True,
                    chunks: int = 0) -> Any:
            return self.reference(mb, temperature=t, shared_prefix=shared_prefix,
                                  packed=packs(mb, self.cfg.packing, shared_prefix), logits_chunks=chunks)

        return self._own_rows_forward(forward, batch, temperature, False)[0]

    def step(self, batch: TokenBatch, loss_fn: LossFn, temperature: float = 1.0, need_entropy: bool = False,
             need_values: bool = False, weight_by: str = "tokens", row_block: int = 1) -> dict[str, float]:
        import torch.distributed as dist

        self._train_mode(True)
        total = float(batch.num_targets if weight_by == "tokens" else len(batch)) or 1.0
        _, parts, mbs, has_prefix, chunks = self._plan(batch, row_block)  # stand-ins (weight 0) past this rank's own
        n_parts = len(mbs)
        stats: dict[str, float] = {}
        loss_sum = 0.0
        policy_grad, critic_grad = True, False  # which engines this step's loss reaches
        for k in range(int(n_parts)):
            idx = parts[k] if k < len(parts) else []
            mb = mbs[k].to(self.device)
            share = (mb.num_targets if weight_by == "tokens" else len(idx)) if idx else 0
            # DeepSpeed averages gradients over ranks: scale by world so the sum over all ranks' shares is 1.
            w = share * self.world / total
            with memory_hint(mbs[k], self.cfg.token_budget, self.device):
                out = self.forward(mb, temperature, need_entropy, need_values, has_prefix[k], chunks[k])
                last = k == int(n_parts) - 1
                if self.critic_ds is not None and "values" in out:
                    # two engines, two backward passes: the loss again with the other network's outputs
                    # detached, so each pass reaches one network (the gradients are the combined loss's)
                    loss, s = loss_fn(mb, dict(out, values=out["values"].detach()))
                    critic_loss, _ = loss_fn(mb, {key: v if key == "values" else v.detach() for key, v in out.items()})
                    # a network the loss does not reach takes no pass and no step (a value-only loss leaves the
                    # policy as it is); the loss's form, hence this, is the same on every rank
                    policy_grad, critic_grad = loss.requires_grad, critic_loss.requires_grad
                    if critic_grad:
                        self.critic_ds.set_gradient_accumulation_boundary(last)
                        self.critic_ds.backward(critic_loss * w, scale_wrt_gas=False)
                else:
                    loss, s = loss_fn(mb, out)
                if policy_grad:
                    self.ds.set_gradient_accumulation_boundary(last)
                    self.ds.backward(loss * w, scale_wrt_gas=False)
            loss_sum += float(loss.detach()) * share / total
            for key, v in s.items():
                stats[key] = stats.get(key, 0.0) + float(v) * share / total
        lr = float(self.optimizer.param_groups[0]["lr"])  # the step's own; the scheduler then sets the next
        if policy_grad:
            self.ds.step()
        critic = self.critic_ds is not None and critic_grad  # SFT's and DPO's steps leave the critic as it is
        if critic:
            self.critic_ds.step()
        # The whole batch's loss and stats: every rank holds its shares; the sum over ranks is the total.
        keys = sorted(stats)
        packed = torch.tensor([loss_sum] + [stats[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(packed)
        self.global_step += 1
        out_stats = dict(zip(keys, packed[1:].tolist()))
        out_stats.update(loss=float(packed[0]), micro_batches=int(n_parts),
                         grad_norm=float(self.ds.get_global_grad_norm() or 0.0) if policy_grad else 0.0,
                         lr=lr)
        if critic:
            out_stats["critic_grad_norm"] = float(self.critic_ds.get_global_grad_norm() or 0.0)
        if policy_grad:
            self._gather_adapter()
        return out_stats

    @torch.no_grad()
    def critic_from_policy(self) -> None:
        """Every rank: the separate critic's transformer takes the policy's weights now (after SFT), each
        parameter gathered from its shards and written back to them; its value head and optimizer start over."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        if self.critic_ds is None:
            return
        critic = self.critic_ds.module
        dst = dict(critic.backbone.named_parameters())
        prefix = f"{self.ds.module.policy.base_model_prefix}."

        def put(p: Any, t: torch.Tensor) -> None:
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):  # the weights the forward uses
                if self.rank == 0:
                    p.data.copy_(t.to(p.dtype))
            if p.ds_numel % self.world == 0:
                safe_set_full_fp32_param(p, t.float().clone())  # and the optimizer's fp32 master copy of them
            else:  # DeepSpeed's setter reads past the end of the last rank's padded shard: write this rank's slice
                part, _ = self.critic_optimizer._get_fp32_opt_state_partition(p, release_swap_buffers=False)
                flat, start = t.float().flatten(), part.numel() * self.rank
                n = max(0, min(part.numel(), flat.numel() - start))
                part.data.zero_()
                part.data[:n].copy_(flat[start:start + n])

        for name, t in self._gathered():  # one parameter at a time, never the whole model in one buffer
            if (p := dst.get(name.removeprefix(prefix))) is not None:
                put(p, t)
        for p in critic.head.parameters():
            put(p, torch.zeros(p.ds_shape if hasattr(p, "ds_shape") else p.shape))
        _reset_adam(self.critic_optimizer)

    def _gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every rank: the policy's parameters, each gathered from its ZeRO-3 shards while it is yielded
        (one at a time: never the whole model in one buffer)."""
        import deepspeed

        if self.cfg.lora is not None:
            yield from merged_lora(self.ds.module.policy)
            return
        for name, p in self.ds.module.policy.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                yield name, p.data

    def _gather_adapter(self) -> None:
        """Every rank (LoRA): gather the adapters; rank 0 keeps a host copy, which ``export_adapter`` writes
        without a collective (the vLLM sync calls it on rank 0 alone). Adapters are small: all at once."""
        import deepspeed

        if self.cfg.lora is None:
            return
        named = [(n, p) for n, p in self.ds.module.policy.named_parameters() if p.requires_grad]
        with torch.no_grad(), deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            self._adapter = {n: p.data.detach().to("cpu", copy=True) for n, p in named} if self.rank == 0 else None

    def export_adapter(self, folder: str | Path) -> Path:
        """Rank 0: the adapters as of the last update, as a PEFT folder (adapter_config.json and
        adapter_model.safetensors) that vLLM loads as a LoRA adapter."""
        if self.cfg.lora is None:
            raise ValueError("export_adapter needs a LoRA engine")
        if self._adapter is None:
            raise RuntimeError("export_adapter runs on rank 0, which holds the gathered adapters")
        self.ds.module.policy.save_pretrained(folder, state_dict=self._adapter)
        return Path(folder)

    def _master_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every rank: the optimizer's fp32 master copy of each policy parameter, gathered one at a time."""
        from deepspeed.utils import safe_get_full_fp32_param

        for name, p in self.ds.module.policy.named_parameters():
            yield name, safe_get_full_fp32_param(p)

    @torch.no_grad()
    def copy_weights_to(self, model: Any) -> None:
        """Every rank: copy the gathered parameters into ``model``, this rank's generator copy."""
        dst = dict(model.named_parameters())
        for name, t in self._gathered():
            if name in dst:
                dst[name].copy_(t.to(dst[name].device, dst[name].dtype))

    @torch.no_grad()
    def iter_weights(self, every_rank: bool = False) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Every rank walks the gathers; rank 0 gets a copy of each parameter, the others None (``every_rank``:
        every rank its own copy, on its GPU: the CUDA IPC sync shares each rank's with its colocated server)."""
        for name, t in self._gathered():
            yield name, (t.detach().clone() if self.rank == 0 or every_rank else None)

    export_shard_mb = EXPORT_SHARD_MB

    def export_weights(self, folder: str | Path, dtype: str | None = None) -> Path:
        """Every rank: an HF folder (config, tokenizer, safetensors shards with their index) written by rank 0,
        streamed: parameters are gathered one at a time and written a shard (``export_shard_mb``) at a time, so
        rank 0 holds at most one shard and one parameter, never the whole model. The weights are written in
        ``dtype`` (None: as the engine holds them); checkpoints pass ``model.export_dtype``."""
        import torch.distributed as dist

        folder = Path(folder)
        cast = getattr(torch, dtype) if dtype is not None else None
        writer = _ShardWriter(folder, self.export_shard_mb * 2**20) if self.rank == 0 else None
        # an fp32 export of bf16 shards: the optimizer's fp32 master weights, not the bf16 ones widened (LoRA: the
        # frozen base has none; its bf16 weights, merged)
        masters = cast == torch.float32 and self.ds.bfloat16_enabled() and self.cfg.lora is None
        weights = self._master_weights() if masters else self._gathered()
        for name, t in weights:
            if writer is not None:
                writer.add(name, t.to(cast) if cast is not None and t.is_floating_point() else t)
        if writer is not None:
            writer.close()
            save_config(self.ds.module.policy.get_base_model() if self.cfg.lora is not None else self.ds.module.policy,
                        folder, dtype or self.dtype)
            self.tokenizer.save_pretrained(folder)
        dist.barrier()
        return folder

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        # LoRA: the frozen base stays out (it is the model folder the engine is built on): adapters and their Adam
        self.ds.save_checkpoint(str(folder / "deepspeed"), client_state={"global_step": self.global_step},
                                exclude_frozen_parameters=self.cfg.lora is not None)
        if self.critic_ds is not None:  # inside the step folder: the checkpoint's manifest covers it
            self.critic_ds.save_checkpoint(str(folder / "critic"), client_state={"global_step": self.global_step})
        self.export_weights(folder / "model", export_dtype("deepspeed", self.cfg))
        torch.save(rng_state(), folder / f"rng-rank{self.rank}.pt")
        return folder

    def load(self, folder: str | Path) -> None:
        folder = Path(folder)
        if self.critic_ds is not None and not (folder / "critic").is_dir():
            raise ValueError(f"{folder} holds no critic/: it was saved without a separate critic "
                             "(algo.critic=shared); resume with algo.critic=shared")
        client = self._load_engine(self.ds, folder / "deepspeed", strict=self.cfg.lora is None)
        self.global_step = (client or {}).get("global_step", 0)
        self._gather_adapter()
        if self.critic_ds is not None:
            self._load_engine(self.critic_ds, folder / "critic")
        rng = folder / f"rng-rank{self.rank}.pt"
        if rng.exists():
            set_rng_state(load_plain(rng))

    def _load_engine(self, engine: Any, ds_dir: Path, strict: bool = True) -> Any:
        """Collective: load one DeepSpeed engine's checkpoint (its client state back). Saved by another number
        of ranks, it is first converted to DeepSpeed's universal checkpoint (rank 0, beside the checkpoint
        folder, removed once loaded), which any number of ranks loads: the same weights, Adam moments, step
        and schedule, re-sharded. ``strict=False``: the checkpoint leaves the frozen weights out (LoRA)."""
        import torch.distributed as dist

        # DeepSpeed's own reader unpickles anything; its files hold tensors, containers and two plain classes
        engine.checkpoint_engine.load = _load_ds_file
        tag = (ds_dir / "latest").read_text().strip() if (ds_dir / "latest").is_file() else None
        saved = saved_world(ds_dir / tag) if tag else self.world
        if saved == self.world:
            _, client = engine.load_checkpoint(str(ds_dir), load_module_strict=strict)
            return client
        universal = ds_dir.parent.with_name(f"universal-{ds_dir.parent.name}-{ds_dir.name}")
        error = None
        if self.rank == 0:
            try:
                to_universal(ds_dir / tag, universal / tag)
            except Exception as e:  # every rank must hear of it, not wait in the barrier below
                error = f"converting {ds_dir} (saved by {saved} ranks) for {self.world}: {type(e).__name__}: {e}"
        box = [error]
        dist.broadcast_object_list(box, src=0)
        if box[0]:
            raise RuntimeError(box[0])
        engine._config.load_universal_checkpoint = True
        try:
            _, client = engine.load_checkpoint(str(universal), tag=tag, load_module_strict=strict)
        finally:
            engine._config.load_universal_checkpoint = False
            dist.barrier()
            if self.rank == 0:
                shutil.rmtree(universal, ignore_errors=True)
        return client

    def close(self) -> None:
        """Leave the process group in step with the other ranks (not after an error). Without this, gloo's and
        DeepSpeed's comm threads are torn down by static destructors at exit, which can abort a rank
        ("terminate called without an active exception") after a run that succeeded."""
        import torch.distributed as dist

        from agentrl import dist as ranks

        if ranks.stopping():  # after an error: no barrier (a peer may never reach it); the process exits
            return
        if dist.is_initialized():
            dist.barrier()
            ranks.stop_watching()  # every rank got here: one that exits first is no failure
            dist.destroy_process_group()
            _forget_deepspeed_groups()


def merged_lora(policy: Any, adapter: str = "default") -> Iterator[tuple[str, torch.Tensor]]:
    """Every rank: a PEFT LoRA model's weights under its base model's HF names, one at a time, each gathered
    from its ZeRO-3 shards; an adapted weight comes merged (W + its adapter's delta, gathered with it)."""
    import deepspeed

    base = policy.get_base_model()
    modules = dict(base.named_modules())
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        layer = modules.get(owner) if owner else None
        if layer is None or leaf != "weight" or adapter not in getattr(layer, "lora_A", {}):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                yield f"{owner}.{leaf}" if owner else name, p.data
            continue
        pair = [layer.lora_A[adapter].weight, layer.lora_B[adapter].weight]
        with deepspeed.zero.GatheredParameters([p, *pair], modifier_rank=None):
            with torch.no_grad():  # not around the yield: the caller's grad mode stays its own
                merged = p.data + layer.get_delta_weight(adapter).to(p.dtype)
            yield f"{owner}.weight", merged


class _ShardWriter:
    """Safetensors shards named and indexed as ``save_pretrained`` writes them, filled one tensor at a time."""

    def __init__(self, folder: Path, shard_bytes: int):
        self.folder, self.limit = folder, shard_bytes
        folder.mkdir(parents=True, exist_ok=True)
        for old in list(folder.glob("model*.safetensors")) + list(folder.glob("model.safetensors.index.json")):
            old.unlink()  # a folder written again: no shard of the last export left to mix in
        self.part: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[list[str]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.part and self.size + n > self.limit:
            self._flush()
        self.part[name] = t.detach().to("cpu", copy=True).contiguous()
        self.size += n

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.part, str(self.folder / f"part-{len(self.files)}.tmp"), metadata={"format": "pt"})
        self.files.append(list(self.part))
        self.total += self.size
        self.part, self.size = {}, 0

    def close(self) -> None:
        if self.part or not self.files:
            self._flush()
        n = len(self.files)
        if n == 1:
            (self.folder / "part-0.tmp").rename(self.folder / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.folder / f"part-{i}.tmp").rename(self.folder / final)
            weight_map.update({k: final for k in names})
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": self.total}, "weight_map": weight_map}, indent=2))


def _forget_deepspeed_groups() -> None:
    """DeepSpeed caches the groups it made from the world group (a clone of it, ZeRO's and the experts'
    groups) in module globals; once that group is destroyed, an engine made later in this process would
    use them and fail ("Group ... is not registered"). Drop them so it makes new ones."""
    from deepspeed.utils import groups

    for name, value in list(vars(groups).items()):
        if name.startswith("_") and (name.endswith("_GROUP") or name.endswith("_GROUP_RANKS")):
            if isinstance(value, dict):
                value.clear()
            elif value is not None and not callable(value):
                setattr(groups, name, None)


class _WithValueHead(torch.nn.Module):
    """One module for DeepSpeed to wrap: the policy and its optional value head. Its forward is the torch
    engine's (only target positions projected to the vocabulary), run inside DeepSpeed's forward so ZeRO-3
    gathers and releases each layer's shards around it; the shared-prefix pass only where the caller says
    every rank takes it."""

    def __init__(self, policy: Any, value_head: Any, logits_chunk: int = 0):
        super().__init__()
        self.policy, self.value_head, self.logits_chunk = policy, value_head, logits_chunk

    def forward(self, mb: TokenBatch, temperature: float = 1.0, need_entropy: bool = False,
                need_values: bool = False, shared_prefix: bool = True, packed: bool = False,
                logits_chunks: int = 0) -> dict[str, torch.Tensor]:
        return forward_batch(self.policy, self.value_head, mb, temperature, need_entropy, need_values,
                             targets_only=True, shared_prefix=shared_prefix, packed=packed,
                             logits_chunk=self.logits_chunk, logits_chunks=logits_chunks)


def _reset_adam(optimizer: Any) -> None:
    """Drop Adam's moments and step counts (the ZeRO optimizer's torch AdamW within): a fresh optimizer."""
    base = getattr(optimizer, "optimizer", optimizer)
    for state in base.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                v.zero_()
