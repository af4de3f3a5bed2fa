"""The connection gate of ``agentrl serve`` (and the capture endpoint): refused connections are logged as one
line per interval with their count, never a traceback; the global pool keeps room for addresses holding few."""
import re
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from types import SimpleNamespace

import pytest
from fastapi import FastAPI

from agentrl.generation import server as S
from agentrl.generation.requests import ServerLimits

FLOOD = textwrap.dedent("""
    import socket, sys, time
    from types import SimpleNamespace
    from fastapi import FastAPI
    from agentrl.logs import setup_logging
    from agentrl.generation import server as S
    from agentrl.generation.requests import ServerLimits
    setup_logging()
    S.REFUSALS_LOG_S = 0.5
    svc = SimpleNamespace(limits=ServerLimits(max_connections=64, max_client_connections=4), close=lambda: None)
    srv = S.serve_app(FastAPI(), svc, "127.0.0.1", 0)
    held = [socket.create_connection(srv.server_address) for _ in range(4)]
    for _ in range(3000):  # past the cap, each closed at once: the server's answer finds the socket gone
        socket.create_connection(srv.server_address).close()
    time.sleep(1.0)
    srv.shutdown()
""")


def test_refused_connections_are_counted_not_traced(caplog, monkeypatch):
    """In process (cheap): 1,000 refused connections closed at once log nothing through asyncio (each was a
    10-line "Exception in callback" traceback) and one agentrl warning line per interval, counting them all."""
    monkeypatch.setattr(S, "REFUSALS_LOG_S", 0.5)
    caplog.set_level("WARNING")
    svc = SimpleNamespace(limits=ServerLimits(max_connections=64, max_client_connections=4), close=lambda: None)
    srv = S.serve_app(FastAPI(), svc, "127.0.0.1", 0)
    held = [socket.create_connection(srv.server_address) for _ in range(4)]
    try:
        for _ in range(1000):
            socket.create_connection(srv.server_address).close()
        time.sleep(0.5)
    finally:
        srv.shutdown()
        for h in held:
            h.close()
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text[-2000:]
    ours = [r.getMessage() for r in caplog.records if r.name == "agentrl.generation.server"]
    assert 1 <= len(ours) <= 6, ours
    assert sum(int(re.match(r"refused (\d+) connections", m).group(1)) for m in ours) == 1000


@pytest.mark.slow
def test_3000_refused_connections_are_a_few_lines_with_their_count():
    """A real server process: 3,000 connections past the per-address cap, each closed by the client at once,
    printed a 10-line traceback each (30,000 lines); now a warning line per interval, counting them all."""
    p = subprocess.run([sys.executable, "-c", FLOOD], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.strip().splitlines()
    assert "Traceback" not in p.stderr and 1 <= len(lines) <= 12, p.stderr[-3000:]
    counts = [re.search(r"WARNING agentrl.generation.server: refused (\d+) connections with a 503 in the last \d+ s: "
                        r"\d+ past the per-address cap of 4 \(127\.0\.0\.1 x\d+\)$", line) for line in lines]
    assert all(counts), lines
    assert sum(int(m.group(1)) for m in counts) == 3000


def _trickle(port: int, source: str, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the rest: held until the header deadline
        out.append(s)
    return out


def _answered(socks: list[socket.socket]) -> list[bytes | None]:
    time.sleep(0.3)
    replies: list[bytes | None] = []
    for s in socks:
        s.settimeout(0)
        try:
            replies.append(s.recv(4096))
        except BlockingIOError:
            replies.append(None)  # held: open, nothing said
    return replies


def test_a_few_addresses_under_their_cap_cannot_fill_the_pool():
    """32 connections in all, 16 per address: 127.0.0.2 holds 16 and 127.0.0.3 could take the other 16, and
    every other client got 503 while they held them. Now the last quarter (8) is kept for addresses holding
    fewer than 8: 127.0.0.3 gets 8, its next 8 are refused at once, and other addresses are served."""
    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok"})
    svc = SimpleNamespace(limits=ServerLimits(max_connections=32, max_client_connections=16, header_timeout_s=5.0),
                          close=lambda: None)
    srv = S.serve_app(app, svc, "127.0.0.1", 0)
    port = srv.server_address[1]
    socks: list[socket.socket] = []
    try:
        socks += _trickle(port, "127.0.0.2", 16)
        big = _trickle(port, "127.0.0.3", 16)
        socks += big
        replies = _answered(big)
        assert replies[:8] == [None] * 8, replies
        assert all(r and r.startswith(b"HTTP/1.1 503") and b"its last 8 of 32 connections are kept for clients "
                   b"holding fewer than 8, and 127.0.0.3 holds 8" in r for r in replies[8:]), replies
        for source in ("127.0.0.1", "127.0.0.4", "127.0.0.5"):  # addresses holding none are served
            c = __import__("http.client").client.HTTPConnection("127.0.0.1", port, timeout=10,
                                                                source_address=(source, 0))
            c.request("GET", "/health")
            assert c.getresponse().status == 200
            c.close()
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).status == 200
    finally:
        for s in socks:
            s.close()
        srv.shutdown()
