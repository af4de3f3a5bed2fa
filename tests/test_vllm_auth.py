"""Servers bound beyond loopback take the run's key on every route: the middleware loaded into vLLM answers
401 without it on the development routes vLLM's own --api-key leaves open (/collective_rpc, /sleep,
/update_weights, ...), the trainer's clients send it on every call, and `agentrl serve --backend vllm`
refuses a public bind without a key. The real server: tests/test_vllm.py (AGENTRL_TEST_VLLM=1)."""
import asyncio

import pytest

from agentrl.generation.vllm import vllm_command
from agentrl.generation.vllm_auth import MIDDLEWARE, EveryRouteKey


def call(app, path, method="POST", key=None):
    sent = []

    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(msg):
        sent.append(msg)

    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    asyncio.run(EveryRouteKey(inner, "s3cret")(scope, None, send) if app is None else app(scope, None, send))
    return sent[0]["status"]


@pytest.mark.parametrize("path", ["/collective_rpc", "/sleep", "/wake_up", "/update_weights", "/pause",
                                  "/init_weight_transfer_engine", "/get_world_size", "/v1/completions",
                                  "/reset_prefix_cache", "/metrics", "/docs"])
def test_every_route_takes_the_key(path):
    assert call(None, path) == 401
    assert call(None, path, key="wrong") == 401
    assert call(None, path, key="s3cret") == 200


def test_health_stays_open_for_liveness_and_the_middleware_needs_a_key(monkeypatch):
    assert call(None, "/health", method="GET") == 200
    assert call(None, "/health", method="POST") == 401
    monkeypatch.delenv("AGENTRL_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="AGENTRL_API_KEY"):
        EveryRouteKey(lambda *a: None)


def test_a_server_bound_beyond_loopback_loads_the_guard_and_a_loopback_one_does_not(tmp_path):
    tiny_model_dir = tmp_path
    assert cmd_has(vllm_command(tiny_model_dir, 9000, host="0.0.0.0", cpu=True, python="py"))
    assert cmd_has(vllm_command(tiny_model_dir, 9000, host="10.1.2.3", cpu=True, python="py"))
    assert not cmd_has(vllm_command(tiny_model_dir, 9000, host="127.0.0.1", cpu=True, python="py"))


def cmd_has(cmd):
    return "--middleware" in cmd and cmd[cmd.index("--middleware") + 1] == MIDDLEWARE


def test_the_trainers_clients_send_the_key_on_the_dev_routes(monkeypatch):
    import urllib.request

    from agentrl.generation.client import RemoteGenerator

    seen = []

    class Reply:
        def __init__(self, req):
            seen.append((req.full_url, req.get_header("Authorization")))

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def read(self):
            return b'{"data": [{"id": "policy"}]}'

    monkeypatch.setattr(urllib.request, "urlopen", lambda req, timeout=None: Reply(req))
    c = RemoteGenerator("http://10.0.0.1:8100", backend="vllm", api_key="k1")
    c.request("POST", "/collective_rpc", {"method": "x"})
    c.request("POST", "/sleep?level=1")
    assert [h for _, h in seen] == ["Bearer k1"] * 3  # /v1/models at construction, then the dev routes


def test_agentrl_serve_refuses_a_public_vllm_bind_without_a_key(monkeypatch, capsys, tmp_path):
    from agentrl.cli import main

    tiny_model_dir = tmp_path
    (tmp_path / "config.json").write_text("{}")  # the folder is never loaded: the bind is refused first
    monkeypatch.delenv("AGENTRL_API_KEY", raising=False)
    monkeypatch.setattr("os.execve", lambda *a: pytest.fail("must not start"))
    rc = main(["serve", "--backend", "vllm", "--model", str(tiny_model_dir), "--host", "0.0.0.0"])
    assert rc == 2 and "--api-key" in capsys.readouterr().err
