"""The harness gate (``--env agent:external``): the trainer serves the capture endpoint, and the episodes come
from harnesses started elsewhere (another process, container, network namespace or host), which take tasks
and report rewards over a small HTTP contract.

One server for the whole run (a harness polls between rollouts too), on ``env_kwargs.host``:``port``
(127.0.0.1 unless another host is asked for), every route but ``/health`` behind ``Authorization: Bearer``
the run's key, ``$AGENTRL_HARNESS_KEY`` (401 without it). The contract:

* ``POST /episodes`` (``?wait_s=N``, 0 to 60, default 20): claim an offered episode. 200 with
  ``{"episode_id", "base_url", "task", "task_id", "timeout_s", "model"}``; 204 when none was offered within
  ``wait_s`` (ask again); 410 once the run is over (stop).
* The chat calls: any OpenAI client on ``base_url`` (``http://HOST:PORT/ep/<episode id>/v1``, the host as the
  harness reached it), or on ``http://HOST:PORT/v1`` with the header ``agentrl-episode: <episode id>``; the
  capture endpoint serves both (``agentrl.generation.capture``).
* ``POST /episodes/<episode id>/reward`` with ``{"reward": number, "success": bool}`` (success optional:
  reward > 0) or ``{"error": "why"}`` (a failed episode): 200, and the episode ends; 404 for an episode that is
  not claimed or has ended (it timed out: ``env_kwargs.timeout_s`` from its claim); 400 naming ``reward``.

With ``env_kwargs.command`` the trainer starts a harness per episode itself and claims the episode for it
(``HarnessGate.hand_out``; ``agentrl.rollout.harness_commands``).

Each rollout (``agentrl.rollout.agent_program``) takes a ``Lane`` with its own ``CaptureService`` (its
sampling differs between training and evaluation; a collect ahead may overlap an evaluation): it offers each
start, hears of claims and rewards, and withdraws an episode at its timeout. A claimed episode's ``/ep/``
requests go to its lane's capture app; any other is a 404.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from agentrl.envs.agent_program import KEY_ENV
from agentrl.generation.capture import MODEL_NAME, make_capture_app
from agentrl.generation.requests import BadRequest, ServerLimits
from agentrl.generation.server import _ApiKey, _error, _read_body, install_error_handlers, serve_app
from agentrl.rollout.program_workers import read_reward

EPISODE_HEADER = b"agentrl-episode"  # the episode of a request to /v1/... (a harness with one fixed base URL)
MAX_WAIT_S = 60.0
QUIET_S = 60.0  # no claim for this long while episodes wait: one warning saying how harnesses connect
log = logging.getLogger(__name__)


class Lane:
    """One rollout's episodes on the gate: ``offer`` a start, ``wait`` for claims (``(key, None)``: its clock
    starts) and rewards (``(key, box)``), ``kill`` one at its timeout, ``close`` when the rollout ends. Rollouts
    running at once (a collect ahead and an evaluation) have a lane each; harnesses claim from any."""

    def __init__(self, gate: "HarnessGate", service: Any):
        service.api_key = gate.key  # the run's key on the /ep/ routes too
        self.gate, self.service, self.app = gate, service, make_capture_app(service)
        self.events: queue.Queue = queue.Queue()  # (key, None: claimed | box: reported)

    def offer(self, key: Any, task: dict[str, Any], eid: str, task_id: str) -> None:
        with self.gate.lock:
            self.gate.offers.append(_Offer(self, key, task, eid, task_id))

    def wait(self, timeout: float) -> list[tuple[Any, dict[str, Any] | None]]:
        out = []
        try:
            out.append(self.events.get(timeout=max(0.0, timeout)))
            while True:
                out.append(self.events.get_nowait())
        except queue.Empty:
            pass
        self.gate.nudge()
        return out

    def kill(self, key: Any) -> None:
        """Withdraw an episode (its timeout, or the rollout stopped): unclaimed, it is offered no more;
        claimed, its reward and its chat requests are refused (404)."""
        with self.gate.lock:
            self.gate.offers = deque(o for o in self.gate.offers if not (o.lane is self and o.key == key))
            for eid in [e for e, (lane, k) in self.gate.claimed.items() if lane is self and k == key]:
                del self.gate.claimed[eid]

    def close(self) -> None:
        with self.gate.lock:
            self.gate.offers = deque(o for o in self.gate.offers if o.lane is not self)
            for eid in [e for e, (lane, _) in self.gate.claimed.items() if lane is self]:
                del self.gate.claimed[eid]


@dataclass
class _Offer:
    lane: Lane
    key: Any  # the rollout's start index
    task: dict[str, Any]
    eid: str
    task_id: str


class HarnessGate:
    """The running gate (see the module's doc): ``url``; ``lane(service)`` for each rollout; ``close``."""

    def __init__(self, key: str, timeout_s: float, host: str = "127.0.0.1", port: int = 0, commands: bool = False):
        self.key, self.timeout_s = key, timeout_s
        self.offers: deque[_Offer] = deque()
        self.claimed: dict[str, tuple[Lane, Any]] = {}  # episode id -> (its lane, its key there)
        self.lock = threading.Lock()
        self.over = False
        self.limits = ServerLimits()
        self._last_claim = time.monotonic()
        self._warned = False
        self._app = self._contract()
        self._server = serve_app(_ApiKey(self._route, key), _Serving(self.limits), host, port)
        h, p = self._server.server_address
        self.url = f"http://{f'[{h}]' if ':' in h else h}:{p}"
        if commands:  # the trainer starts them: nobody else need connect
            log.info("agent:external: each episode's command (env_kwargs.command) reaches the gate at %s", self.url)
        else:
            log.warning("agent harnesses: POST %s/episodes with Authorization: Bearer $%s (docs/guides/tools.md)",
                        self.url, KEY_ENV)

    def lane(self, service: Any) -> Lane:
        return Lane(self, service)

    def nudge(self) -> None:
        """Once per run: episodes wait and no harness has claimed one for ``QUIET_S``; say how to connect."""
        if self.offers and not self._warned and time.monotonic() - self._last_claim > QUIET_S:
            self._warned = True
            log.warning("agent:external: %d episodes wait and no harness has claimed one for %.0f s; harnesses "
                        "POST %s/episodes with Authorization: Bearer $%s", len(self.offers), QUIET_S, self.url,
                        KEY_ENV)

    def close(self) -> None:
        """Claims are answered 410 from now on, then the server stops (safe to call twice)."""
        self.over = True
        time.sleep(0.3)  # the long polls waiting see it and answer 410
        self._server.server_close()

    # ----- the server's side (its event loop) ---------------------------------------------------------
    async def _route(self, scope: Any, receive: Any, send: Any) -> None:
        """``/ep/<episode id>/...`` (or ``/v1/...`` with the episode in a header) to the capture app of the
        episode's lane, once claimed; everything else to the contract's routes."""
        if scope["type"] == "http":
            path = scope["path"]
            eid = next((v.decode("latin-1") for k, v in scope["headers"] if k == EPISODE_HEADER), "")
            if path.startswith("/v1/") and eid:
                path = f"/ep/{eid}{path}"
                scope = {**scope, "path": path, "raw_path": path.encode()}
            if path.startswith("/ep/"):
                claimed = self.claimed.get(path.split("/", 3)[2])
                if claimed is None:
                    return await _error(404, "no claimed episode with this id (claim one with POST /episodes; it "
                                             "ends when its reward is reported or it times out)")(scope, receive, send)
                return await claimed[0].app(scope, receive, send)
        await self._app(scope, receive, send)

    def _claim(self) -> _Offer | None:
        with self.lock:
            if not self.offers:
                return None
            offer = self.offers.popleft()
            self._take(offer)
        return offer

    def _take(self, offer: _Offer) -> None:
        """``offer`` is claimed (the lock held): its requests and its reward are taken from now on."""
        self.claimed[offer.eid] = (offer.lane, offer.key)
        offer.lane.service.go_live(offer.eid)  # its requests may now come: the scheduler waits for them
        offer.lane.events.put((offer.key, None))  # inside the lock: a kill() after it sees the claim
        self._last_claim = time.monotonic()

    def hand_out(self, lane: Lane, key: Any, task: dict[str, Any], eid: str, task_id: str) -> None:
        """Claim an episode for a harness the trainer starts itself (``agentrl.rollout.harness_commands``):
        never offered, so no other harness can claim it."""
        with self.lock:
            self._take(_Offer(lane, key, task, eid, task_id))

    def local_url(self) -> str:
        """The gate as a process on this machine reaches it (a wildcard address is not one to connect to)."""
        host, port = self._server.server_address[:2]
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def _report(self, eid: str, box: dict[str, Any]) -> None:
        with self.lock:
            if (claimed := self.claimed.pop(eid, None)) is None:
                raise BadRequest(f"no claimed episode '{eid[:40]}' (it ended, timed out, or was never claimed)",
                                 status=404)
            lane, key = claimed
            lane.events.put((key, box))

    def _contract(self) -> FastAPI:
        app = FastAPI(title="agentrl harness gate", docs_url=None, redoc_url=None, openapi_url=None)
        install_error_handlers(app)

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.post("/episodes")
        async def claim(request: Request, wait_s: float = 20.0) -> Response:
            if not 0 <= wait_s <= MAX_WAIT_S:  # NaN too
                raise BadRequest(f"'wait_s' must be from 0 to {MAX_WAIT_S:g} seconds, got {wait_s}", "wait_s")
            deadline = time.monotonic() + wait_s
            while not self.over:
                if (offer := self._claim()) is not None:
                    # the address the harness reached: behind a TLS proxy, its host and scheme
                    host = request.headers.get("host") or self.url.split("//", 1)[1]
                    scheme = "https" if request.headers.get("x-forwarded-proto") == "https" else "http"
                    return JSONResponse({"episode_id": offer.eid, "base_url": f"{scheme}://{host}/ep/{offer.eid}/v1",
                                         "task": offer.task, "task_id": offer.task_id, "timeout_s": self.timeout_s,
                                         "model": MODEL_NAME})
                if time.monotonic() >= deadline:
                    return Response(status_code=204)
                await asyncio.sleep(0.05)
            return _error(410, "the run is over: no more episodes")

        @app.post("/episodes/{eid}/reward")
        async def reward(eid: str, request: Request) -> dict[str, bool]:
            try:
                body = json.loads(await _read_body(request, self.limits) or b"{}")
            except ValueError as e:
                raise BadRequest(f"the request body is not valid JSON ({e})") from None
            if not isinstance(body, dict) or ("reward" in body) == ("error" in body):
                raise BadRequest("the body must be {'reward': number, 'success': bool} or {'error': 'why'}", "reward")
            if "error" in body:
                box: dict[str, Any] = {"error": f"HarnessError: {str(body['error'])[:500]}"}
            else:
                try:
                    box = {"reward": read_reward(body)}
                except ValueError as e:
                    raise BadRequest(str(e).replace("the program returned", "'reward' is"), "reward") from None
            self._report(eid, box)
            return {"ok": True}

        return app


@dataclass
class _Serving:
    """What ``serve_app`` needs of a service: the limits, and a close (the gate has nothing to stop)."""

    limits: ServerLimits

    def close(self) -> None:
        pass


def harness_gate(spec: Any) -> HarnessGate:
    """The gate for an ``agent:external`` env's options (``host``, ``port``, ``timeout_s``) and the run's key
    (with ``command``, a fresh one when none is given: only the commands, which are handed it, need it)."""
    from agentrl.dist import rank

    key = os.environ.get(KEY_ENV) or (secrets.token_hex(16) if spec.command else os.environ[KEY_ENV])
    return HarnessGate(key, spec.timeout_s, spec.host, spec.port + rank() if spec.port else 0, bool(spec.command))
