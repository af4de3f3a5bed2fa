"""A key on every route of a vLLM server the trainer starts beyond loopback.

vLLM 0.32's own ``--api-key`` guards only the paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
(``vllm/entrypoints/serve/middleware/authenticate.py``): the development routes a weight sync needs
(``/collective_rpc``, ``/update_weights``, ``/sleep``, ``/pause``, ...) stay open to anyone who reaches the
port. This ASGI middleware, loaded into the server with vLLM's ``--middleware``, answers 401 to any request
without ``Authorization: Bearer <key>`` on every route but ``GET /health`` (liveness only, as ``agentrl
serve`` keeps it); the key is read from the server's environment
(``AGENTRL_API_KEY``), never from its command line (which every user of the node can list).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

KEY_ENV = "AGENTRL_API_KEY"
MIDDLEWARE = "agentrl.generation.vllm_auth.EveryRouteKey"


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


class EveryRouteKey:
    def __init__(self, app: Any, key: str | None = None):
        self.app = app
        key = key if key is not None else os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(f"{MIDDLEWARE} needs the key in ${KEY_ENV}")
        self.digest = _digest(key)

    def allowed(self, scope: dict[str, Any]) -> bool:
        for name, value in scope.get("headers") or []:
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token.strip()), self.digest)
        return False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") not in ("http", "websocket") or self.allowed(scope) or (
                scope.get("path") == "/health" and scope.get("method") in ("GET", "HEAD")):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized: this server takes requests with its run's key"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def run_key() -> str:
    """The key of this run's servers: ``$AGENTRL_API_KEY`` when set (servers started by hand take the same),
    else a fresh random one (rank 0 hands it to every rank over the process group)."""
    import secrets

    return os.environ.get(KEY_ENV) or secrets.token_urlsafe(24)
