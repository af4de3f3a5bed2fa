"""Serving the viewer's app the way `agentrl serve` serves its own (``agentrl.generation.server.serve_app``:
uvicorn on a thread, the same per-client connection and header-deadline limits)."""
from __future__ import annotations

from typing import Any

from agentrl.generation.requests import ServerLimits
from agentrl.generation.server import RunningServer, serve_app
from agentrl.viewer.app import make_app


class _Pages:
    """What ``serve_app`` asks of a service: its limits, and a close at shutdown (nothing to release)."""

    limits = ServerLimits()

    def close(self) -> None:
        pass


def start_viewer(runs: list[Any], host: str = "127.0.0.1", port: int = 8200, api_key: str | None = None
                 ) -> RunningServer:
    """The viewer on ``host:port`` (0: a free port, ``server.server_address``) in a background thread."""
    return serve_app(make_app(runs, api_key), _Pages(), host, port)
