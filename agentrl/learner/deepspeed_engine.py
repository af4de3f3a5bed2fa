"""DeepSpeed ZeRO learner engine (stage 3 by default), same protocol as ``TorchEngine``.

Launch with ``deepspeed`` or ``torchrun`` on GPU nodes; on CPU it runs for real with gloo
(``DS_ACCELERATOR=cpu torchrun --nproc_per_node=2``), which is how the test suite covers it. Each rank
trains on its share of the batch (rows rank, rank + world, ...); losses are weighted so the averaged
gradient equals the token-mean gradient of the whole batch. A torch AdamW is handed to DeepSpeed (no
cpu_adam build needed); ``export_weights`` gathers the sharded parameters and rank 0 writes an HF folder.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from agentrl.learner.batch import TokenBatch, micro_batches
from agentrl.learner.engine import (EngineConfig, LossFn, ValueHead, batched_forward, forward_batch, rng_state,
                                    set_rng_state)

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


def load_ds_config(spec: str | Path | dict | None) -> dict[str, Any]:
    if spec is None:
        return json.loads(json.dumps(ZERO3))
    if isinstance(spec, dict):
        return spec
    return json.loads(Path(spec).read_text())


class DeepSpeedEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None,
                 ds_config: str | Path | dict | None = None):
        import deepspeed
        import torch.distributed as dist

        from agentrl.learner.models import load_model, load_tokenizer

        self.cfg = config or EngineConfig()
        if not dist.is_initialized():
            backend = "gloo" if self.cfg.device == "cpu" else "nccl"
            deepspeed.init_distributed(dist_backend=backend)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(self.cfg.seed)
        ds = load_ds_config(ds_config)
        if self.cfg.optim.grad_clip is not None:
            ds["gradient_clipping"] = self.cfg.optim.grad_clip
        else:
            ds.pop("gradient_clipping", None)
        self.tokenizer = load_tokenizer(model_dir)
        model = load_model(model_dir, self.cfg.dtype, "cpu")
        if self.cfg.lora is not None:
            from agentrl.learner.engine import TorchEngine

            model = TorchEngine._wrap_lora(model, self.cfg.lora)
        self.value_head = ValueHead(model.config.hidden_size) if self.cfg.value_head else None
        module = _WithValueHead(model, self.value_head)
        params = [p for p in module.parameters() if p.requires_grad]
        opt = self.cfg.optim
        optimizer = torch.optim.AdamW(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
        self.ds, self.optimizer, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds,
                                                             model_parameters=params)
        self.global_step = 0

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def local_rows(self, batch: TokenBatch) -> list[int]:
        return list(range(self.rank, len(batch), self.world))

    def partition_numel(self) -> int:
        """Parameter elements this rank holds (ZeRO-3 shards parameters across ranks)."""
        return sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in self.ds.module.parameters())

    def full_numel(self) -> int:
        return sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in self.ds.module.parameters())

    def forward(self, mb: TokenBatch, temperature: float = 1.0, need_entropy: bool = False,
                need_values: bool = False) -> dict[str, torch.Tensor]:
        return forward_batch(self.ds, self.ds.module.value_head, mb, temperature, need_entropy, need_values)

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch, temperature: float = 1.0) -> torch.Tensor:
        """Every rank computes the whole batch (ZeRO-3 forward is collective: all ranks must take part)."""
        self.ds.eval()
        return batched_forward(self.forward, batch, self.cfg.token_budget, temperature)[0]

    def step(self, batch: TokenBatch, loss_fn: LossFn, temperature: float = 1.0, need_entropy: bool = False,
             need_values: bool = False, weight_by: str = "tokens") -> dict[str, float]:
        import torch.distributed as dist

        self.ds.train()
        local = batch.select(self.local_rows(batch))
        totals = torch.tensor([float(batch.num_targets if weight_by == "tokens" else len(batch))])
        parts = micro_batches(local, self.cfg.token_budget)
        # Ranks must run the same number of collective forward/backward passes.
        n_parts = torch.tensor([len(parts)])
        dist.all_reduce(n_parts, op=dist.ReduceOp.MAX)
        parts += [[]] * (int(n_parts) - len(parts))
        stats: dict[str, float] = {}
        loss_sum = torch.zeros(1)
        for k, idx in enumerate(parts):
            last = k == len(parts) - 1
            mb = local.select(idx) if idx else local.select([0])
            share = (mb.num_targets if weight_by == "tokens" else len(idx)) if idx else 0
            # DeepSpeed averages gradients over ranks: scale by world so the sum over all ranks' shares is 1.
            w = share * self.world / float(totals[0])
            out = self.forward(mb, temperature, need_entropy, need_values)
            loss, s = loss_fn(mb, out)
            self.ds.set_gradient_accumulation_boundary(last)
            self.ds.backward(loss * w, scale_wrt_gas=False)
            loss_sum += float(loss.detach()) * share / float(totals[0])
            for key, v in s.items():
                stats[key] = stats.get(key, 0.0) + v * share / float(totals[0])
        self.ds.step()
        dist.all_reduce(loss_sum)
        self.global_step += 1
        stats.update(loss=float(loss_sum[0]), micro_batches=len(parts),
                     grad_norm=float(self.ds.get_global_grad_norm() or 0.0))
        return stats

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Gather the sharded parameters; rank 0 gets a full state dict, other ranks None."""
        import deepspeed

        module = self.ds.module.policy
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            if self.rank == 0:
                return {k: v.detach().clone() for k, v in module.state_dict().items()}
        return None

    def export_weights(self, folder: str | Path) -> Path:
        import torch.distributed as dist

        if self.cfg.lora is not None:  # on every rank, before the collective gather (rank 0 alone would hang the rest)
            raise NotImplementedError("export of LoRA under ZeRO-3: use export_adapter")
        folder = Path(folder)
        sd = self.full_state_dict()
        if self.rank == 0:
            policy = self.ds.module.policy
            policy.save_pretrained(folder, state_dict=sd, safe_serialization=True)
            self.tokenizer.save_pretrained(folder)
        dist.barrier()
        return folder

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        self.ds.save_checkpoint(str(folder / "deepspeed"), client_state={"global_step": self.global_step})
        self.export_weights(folder / "model")
        torch.save(rng_state(), folder / f"rng-rank{self.rank}.pt")
        return folder

    def load(self, folder: str | Path) -> None:
        folder = Path(folder)
        _, client = self.ds.load_checkpoint(str(folder / "deepspeed"))
        self.global_step = (client or {}).get("global_step", 0)
        rng = folder / f"rng-rank{self.rank}.pt"
        if rng.exists():
            set_rng_state(torch.load(rng, weights_only=False))


    def close(self) -> None:
        """Leave the process group in step with the other ranks. Without this, gloo's and DeepSpeed's
        comm threads are torn down by static destructors at exit, which can abort a rank
        ("terminate called without an active exception") after a run that succeeded."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


class _WithValueHead(torch.nn.Module):
    """One module for DeepSpeed to wrap: the policy and its optional value head."""

    def __init__(self, policy: Any, value_head: Any):
        super().__init__()
        self.policy, self.value_head = policy, value_head

    def forward(self, **kwargs: Any) -> Any:
        return self.policy(**kwargs)


def launched_by_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
