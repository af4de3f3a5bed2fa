"""Where generated env data (compiled games, generated task sets) is cached."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """``$AGENTRL_CACHE`` (default ``~/.cache/agentrl``) / parts, created on demand."""
    root = Path(os.environ.get("AGENTRL_CACHE") or Path.home() / ".cache" / "agentrl")
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
