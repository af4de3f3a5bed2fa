"""Diagnostics go through ``logging``: each module logs to ``logging.getLogger(__name__)``, all under the
``agentrl`` logger. The progress lines (steps, evaluations, SFT passes) are the product's output and stay
on stdout. The ``agentrl`` command installs one handler (``setup_logging``); a program that drives agentrl
from Python configures logging as it likes (without any configuration, warnings still reach stderr).
"""
from __future__ import annotations

import logging
import os
import sys

from agentrl.schema import ConfigError

LEVEL_ENV = "AGENTRL_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class _Handler(logging.StreamHandler):
    """The handler ``setup_logging`` installs (told apart from a user's own, so a second call replaces it)."""


def setup_logging(level: str | None = None) -> int:
    """One line per record on stderr for the ``agentrl`` loggers, at ``level`` (else ``$AGENTRL_LOG_LEVEL``,
    else INFO); under several ranks each line names its rank. Below DEBUG, transformers' own progress bars
    (loading and saving weights) are turned off unless ``HF_HUB_DISABLE_PROGRESS_BARS`` says otherwise.
    Returns the level set. For the command line: a library never configures logging on import."""
    name = (level or os.environ.get(LEVEL_ENV) or "INFO").upper()
    if name not in LEVELS:
        raise ConfigError(f"bad log level {name.lower()!r} (--log-level or {LEVEL_ENV}); allowed: "
                          f"{', '.join(x.lower() for x in LEVELS)}")
    # the launcher's variables (``agentrl.dist`` reads the same), without importing torch for them
    rank = f"[rank {os.environ.get('RANK', '0')}] " if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else ""
    handler = _Handler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {rank}%(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("agentrl")
    for old in [h for h in logger.handlers if isinstance(h, _Handler)]:
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(name)
    logger.propagate = False  # a root handler of the caller's would print every line twice
    # transformers' bars at every model load and save would bury the progress lines; the variable is read
    # when transformers is imported, so one imported already is told directly
    if name != "DEBUG" and os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1") == "1" \
            and "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    return logger.level
