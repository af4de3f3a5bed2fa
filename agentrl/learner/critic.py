"""A separate critic network for PPO: its own transformer (the policy's architecture without the LM head,
initialised from the policy's weights or another folder) and a linear value head on its last hidden state.

RAGEN (on verl) and OpenRLHF train a critic model of its own, so the value loss moves no policy weight; the
alternative, a value head on the policy's own hidden state (``ValueHead`` on the policy, ``algo.critic:
shared``), trains the policy's decoder with the value loss too. The engines own the critic's optimizer,
its learning rate (``optim.critic_lr``) and its checkpoint files; this module is the network alone.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agentrl.learner.batch import TokenBatch
from agentrl.learner.hidden import decoder_hidden, pack_index, packed_hidden


class ValueHead(torch.nn.Module):
    """One linear unit on a hidden state, zero at the start (the first advantages are the returns)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.v = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.v.weight)
        torch.nn.init.zeros_(self.v.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # in the head's own dtype: fp32 (the torch engine's, also under autocast), bf16 in DeepSpeed's bf16 shards
        return self.v(h.to(self.v.weight.dtype)).float()[..., 0]


class Critic(torch.nn.Module):
    """V(prefix) at every position but the last, shaped like the policy's targets (B, T-1)."""

    def __init__(self, backbone: Any):
        super().__init__()
        self.backbone = backbone
        self.head = ValueHead(backbone.config.hidden_size)

    @property
    def config(self) -> Any:
        return self.backbone.config

    def forward(self, mb: TokenBatch, shared_prefix: bool = True, packed: bool = False,
                prefix_tree: bool = False) -> torch.Tensor:
        """``prefix_tree``: ``decoder_hidden``'s (the torch engine's; not under ZeRO-3)."""
        if packed:  # the head on each real token once, read back into the padded layout (padding reads 0)
            index = pack_index(mb.attention_mask)[:, :-1]
            return self.head(packed_hidden(self.backbone, mb))[index] * mb.attention_mask[:, 1:]
        pos = (mb.attention_mask.cumsum(-1) - 1).clamp(min=0)
        hidden = decoder_hidden(self.backbone, mb, pos, shared_prefix, prefix_tree)
        return self.head(hidden[:, :-1])


def load_critic(folder: str | Path, dtype: str = "float32", device: str = "cpu") -> Critic:
    """A critic whose transformer is the one in ``folder`` (an HF causal-LM folder: its LM head is left
    out) and whose value head starts at zero."""
    from transformers import AutoModel

    from agentrl.learner.models import cap_kernel_caches

    cap_kernel_caches()
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"algo.critic_path: {folder} is not a model folder (no config.json); give an HF "
                                "model folder, or leave algo.critic_path empty to start the critic from the policy")
    backbone = AutoModel.from_pretrained(str(folder), dtype=getattr(torch, dtype))
    return Critic(backbone).to(device)
