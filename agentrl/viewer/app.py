"""`agentrl view`'s web app: run folders' curves and rollout records over a small JSON API, and the page
(plain HTML, JS and CSS shipped in agentrl/viewer/static; nothing is fetched from elsewhere).

Routes: ``/`` the page; ``/api/runs`` the runs opened; ``/api/runs/{i}/metrics`` a run's metric rows;
``/api/runs/{i}/steps?split=`` its recorded steps' headers; ``/api/runs/{i}/step/{n}?split=`` one step's
episodes. With an API key every route but ``/health`` needs ``Authorization: Bearer KEY`` or, for a
browser, the key once in the page's address (``?key=KEY``), kept in a cookie.
"""
from __future__ import annotations

import hmac
import math
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from agentrl.runs import RunRecords

STATIC = Path(__file__).resolve().parent / "static"
COOKIE = "agentrl_view_key"


def _finite(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """JSON has no NaN or infinity: such values go as null."""
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in rows]


def make_app(runs: list[RunRecords], api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="agentrl view", docs_url=None, redoc_url=None, openapi_url=None)

    if api_key:
        want = api_key.encode()

        @app.middleware("http")
        async def check_key(request: Request, call_next: Any) -> Response:
            if request.url.path == "/health":
                return await call_next(request)
            given = request.query_params.get("key")
            got = (request.headers.get("authorization", "").removeprefix("Bearer ") or given
                   or request.cookies.get(COOKIE) or "")
            if not hmac.compare_digest(got.encode(), want):
                return JSONResponse({"error": "missing or wrong key (Authorization: Bearer KEY, or ?key=KEY)"}, 401)
            if given and request.url.path == "/":  # the key once in the address, then a cookie
                resp = RedirectResponse("/", 303)
                resp.set_cookie(COOKIE, api_key, httponly=True, samesite="strict")
                return resp
            return await call_next(request)

    def run(i: int) -> RunRecords:
        if not 0 <= i < len(runs):
            raise HTTPException(404, f"no run {i} (runs 0..{len(runs) - 1})")
        runs[i].refresh()
        return runs[i]

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/api/runs")
    def list_runs() -> list[dict[str, Any]]:
        out = []
        for i, r in enumerate(runs):
            r.refresh()
            cfg = r.config
            out.append(dict(id=i, name=r.name, path=str(r.path), recipe=cfg.get("recipe", ""), env=cfg.get("env", ""),
                            steps=r.steps("train"), eval_steps=r.steps("eval")))
        return out

    @app.get("/api/runs/{i}/metrics")
    def metrics(i: int) -> list[dict[str, Any]]:
        return _finite(run(i).metrics())

    @app.get("/api/runs/{i}/steps")
    def steps(i: int, split: str = "train") -> list[dict[str, Any]]:
        _split(split)
        return run(i).heads(split)

    @app.get("/api/runs/{i}/step/{n}")
    def step(i: int, n: int, split: str = "train") -> dict[str, Any]:
        _split(split)
        try:
            s = run(i).step(n, split)
        except KeyError as e:
            raise HTTPException(404, str(e.args[0])) from None
        return dict(step=s.step, split=s.split, groups_total=s.groups_total, episodes_total=s.episodes_total,
                    episodes=s.episodes)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _split(split: str) -> None:
    if split not in ("train", "eval"):
        raise HTTPException(400, f"split must be train or eval, not {split!r}")
