"""Which weights ``agentrl serve`` may load: a folder under a directory named at start-up
(``--allow-weights-dir``), holding safetensors of the served architecture with every tensor name and
shape the model has, finite, of a floating dtype where the model's is. Every path is resolved (symlinks
followed) and must stay under an allowed directory. Checked in full before anything is swapped; nothing
is ever downloaded."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


class WeightsRefused(PermissionError):
    """The path is not under an allowed directory (HTTP 403; the message does not say whether it exists)."""


def _under(path: Path, allow: list[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in allow)


def allowed_folder(path: Any, allow: list[Path]) -> Path:
    if not isinstance(path, str) or not path:
        raise ValueError("'path' must be a non-empty string")
    folder = Path(os.path.realpath(Path(path).expanduser()))
    if not _under(folder, allow):
        raise WeightsRefused(f"'{path}' is not under a directory this server may load weights from "
                             "(start it with --allow-weights-dir DIR)")
    return folder


def _own_file(folder: Path, name: Path, allow: list[Path]) -> Path:
    """``name`` inside ``folder`` with its links followed: it must still be under an allowed directory (a link
    in an allowed folder to a file elsewhere would read that file) and be a regular file (not a pipe)."""
    real = Path(os.path.realpath(name))
    if allow and not _under(real, allow):
        raise WeightsRefused(f"{folder}: {name.name} links outside the directories this server may load weights "
                             "from; nothing was loaded")
    if not real.is_file():
        raise ValueError(f"{folder}: {name.name} is not a regular file; nothing was loaded")
    return real


def read_checked(folder: Path, model: Any, allow: list[Path] | None = None) -> dict[str, torch.Tensor]:
    """The folder's tensors, after checking they are exactly this model's (architecture, names, shapes),
    every one finite and floating where the model's is. ``allow``: the directories every file must resolve
    under (the server passes its ``--allow-weights-dir`` list)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    allow = allow or []
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise ValueError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        cfg = json.loads(_own_file(folder, cfg_file, allow).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{folder}: config.json is not valid JSON ({e})") from None
    served = model.config
    if not isinstance(cfg, dict) or cfg.get("model_type") != served.model_type or \
            cfg.get("architectures") != served.architectures:
        got = cfg if not isinstance(cfg, dict) else f"{cfg.get('architectures')} ({cfg.get('model_type')})"
        raise ValueError(f"{folder}: architecture {got} is not the served {served.architectures} "
                         f"({served.model_type})")
    files = [_own_file(folder, f, allow) for f in sorted(folder.glob("*.safetensors"))]
    if not files:
        raise ValueError(f"{folder}: no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{folder}: {f.name} is not a readable safetensors file ({e}); nothing was loaded") \
                from None
    want = model.state_dict()
    tied = {"lm_head.weight"} if getattr(served, "tie_word_embeddings", False) else set()
    missing = sorted(set(want) - set(tensors) - tied)
    unknown = sorted(set(tensors) - set(want))
    wrong = sorted(k for k in set(want) & set(tensors) if tuple(want[k].shape) != tuple(tensors[k].shape))
    if missing or unknown or wrong:
        raise ValueError(f"{folder}: tensors do not match the served model (missing {missing[:3]}, unknown "
                         f"{unknown[:3]}, other shapes {wrong[:3]}); nothing was loaded")
    for k in sorted(tensors):
        t, own = tensors[k], want[k]
        if own.is_floating_point() and not t.is_floating_point():
            raise ValueError(f"{folder}: tensor {k} is {str(t.dtype).removeprefix('torch.')}, the served model's is "
                             f"{str(own.dtype).removeprefix('torch.')}; nothing was loaded")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"{folder}: tensor {k} has {bad} NaN or infinite values; nothing was loaded")
    return tensors


def load_into(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        state = model.state_dict()
        for k, v in tensors.items():
            state[k].copy_(v.to(state[k].dtype))
