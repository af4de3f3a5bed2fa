"""Ending this process at once without leaving its servers behind.

Some stops cannot unwind the stack: a collective or an NCCL transfer whose peer died never returns, and the
SIGTERM of a launcher must end the run now. They call :func:`exit_now` (``os._exit``), which first stops
what this process started in process groups of its own (the vLLM servers: a signal to this process's group
does not reach them), so no server keeps its GPUs and port for the resumed run to trip over.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Callable, NoReturn

_stops: dict[int, Callable[[], None]] = {}  # key -> a quick stop (no waiting on the child's good will)
_lock = threading.Lock()


def on_exit(key: int, stop: Callable[[], None]) -> None:
    """Run ``stop`` before a hard exit of this process, until ``forget(key)``."""
    with _lock:
        _stops[key] = stop


def forget(key: int) -> None:
    with _lock:
        _stops.pop(key, None)


def stop_children() -> None:
    """Run every registered stop now (each once; one that fails does not keep the others from running)."""
    with _lock:
        stops = list(_stops.values())
        _stops.clear()
    for stop in stops:
        try:
            stop()
        except Exception:  # noqa: BLE001 - exiting anyway: the next stop matters more than this error
            pass


def exit_now(code: int) -> NoReturn:
    """Stop this process's servers, flush the standard streams and ``os._exit(code)``."""
    stop_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
