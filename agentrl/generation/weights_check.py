"""Which weights ``agentrl serve`` may load: a folder under a directory named at start-up
(``--allow-weights-dir``), holding safetensors of the served architecture with every tensor name and
shape the model has. Checked in full before anything is swapped; nothing is ever downloaded."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


class WeightsRefused(PermissionError):
    """The path is not under an allowed directory (HTTP 403; the message does not say whether it exists)."""


def allowed_folder(path: Any, allow: list[Path]) -> Path:
    if not isinstance(path, str) or not path:
        raise ValueError("'path' must be a non-empty string")
    folder = Path(path).expanduser().resolve()
    if not any(folder == root or folder.is_relative_to(root) for root in allow):
        raise WeightsRefused(f"'{path}' is not under a directory this server may load weights from "
                             "(start it with --allow-weights-dir DIR)")
    return folder


def read_checked(folder: Path, model: Any) -> dict[str, torch.Tensor]:
    """The folder's tensors, after checking they are exactly this model's (architecture, names, shapes)."""
    from safetensors.torch import load_file

    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{folder}: no config.json (not a Hugging Face model folder)")
    cfg = json.loads(cfg_file.read_text())
    served = model.config
    if cfg.get("model_type") != served.model_type or cfg.get("architectures") != served.architectures:
        raise ValueError(f"{folder}: architecture {cfg.get('architectures')} ({cfg.get('model_type')}) is not the "
                         f"served {served.architectures} ({served.model_type})")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    want = model.state_dict()
    tied = {"lm_head.weight"} if getattr(served, "tie_word_embeddings", False) else set()
    missing = sorted(set(want) - set(tensors) - tied)
    unknown = sorted(set(tensors) - set(want))
    wrong = sorted(k for k in set(want) & set(tensors) if tuple(want[k].shape) != tuple(tensors[k].shape))
    if missing or unknown or wrong:
        raise ValueError(f"{folder}: tensors do not match the served model (missing {missing[:3]}, unknown "
                         f"{unknown[:3]}, other shapes {wrong[:3]}); nothing was loaded")
    return tensors


def load_into(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        state = model.state_dict()
        for k, v in tensors.items():
            state[k].copy_(v.to(state[k].dtype))
