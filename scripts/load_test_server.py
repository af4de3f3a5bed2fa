"""Load test `agentrl serve` on loopback: many concurrent clients for a while, with a mix of normal,
oversized, abandoned (the client hangs up mid-generation) and malformed requests.

Starts a real ``agentrl serve --model MODEL`` process on a free loopback port, runs the clients (asyncio,
httpx for whole requests, raw sockets for hang-ups and broken framing), then prints one JSON line:
normal requests sent / answered, their p50 / p99 latency, every non-200 status by code (and what sent
it), the server's peak RSS, and whether it still answers at the end.

    python scripts/load_test_server.py --clients 200 --seconds 60
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import httpx
import psutil

KINDS = ["normal"] * 7 + ["oversized", "abandoned", "malformed"]  # 70% normal, 10% each of the others


def _free_port() -> int:
    from agentrl.launch import free_port

    return free_port()


async def _raw(port: int, data: bytes, hang_up_after: float | None) -> int | None:
    """Send ``data`` on a fresh connection; hang up after ``hang_up_after`` s (None: read the status)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        if hang_up_after is not None:
            await asyncio.sleep(hang_up_after)
            return None
        line = await asyncio.wait_for(reader.readline(), 60)
        return int(line.split()[1]) if line.startswith(b"HTTP/") else -1
    finally:
        writer.close()


def _post(body: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class Load:
    def __init__(self, port: int, context: int, vocab: int, seed: int):
        self.port, self.context, self.vocab = port, context, vocab
        self.rng = random.Random(seed)
        self.sent: Counter = Counter()
        self.codes: Counter = Counter()  # "CODE kind" for every answer that is not a 200
        self.latencies: list[float] = []
        self.normal_answered = 0
        self.normal_failed: Counter = Counter()
        self.examples: list[str] = []  # the first few client-side exceptions, as they were raised
        # encoded once: a client that spends its time in json.dumps sends little
        self.too_big = [json.dumps(b).encode() for b in (
            {"prompt": self._ids(context + 100), "max_tokens": 1},  # over the context
            {"prompt": [1, 2, 3], "n": 64, "max_tokens": context - 3},  # over the request budget
            {"prompt": [[1] * 2000] * 600, "max_tokens": 1})]  # over the prompt-id cap

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    async def client(self, http: httpx.AsyncClient, until: float) -> None:
        while time.monotonic() < until:
            kind = self.rng.choice(KINDS)
            self.sent[kind] += 1
            try:
                code = await getattr(self, kind)(http)
            except Exception as e:  # a connection error is a failure too; the run goes on
                code = type(e).__name__
                if len(self.examples) < 5:
                    self.examples.append(f"{kind}: {e!r} ({e.__context__!r})")
            if code != 200:
                self.codes[f"{code} {kind}"] += 1

    async def normal(self, http: httpx.AsyncClient) -> int | str:
        body = {"prompt": self._ids(self.rng.randint(8, 64)), "max_tokens": 16, "temperature": 1.0,
                "seed": [self.rng.randrange(1 << 31)]}
        t = time.monotonic()
        try:
            r = await http.post("/v1/completions", json=body)
        except Exception as e:
            self.normal_failed[type(e).__name__] += 1
            raise
        if r.status_code == 200 and len(r.json()["choices"]) == 1:
            self.latencies.append(time.monotonic() - t)
            self.normal_answered += 1
        else:
            self.normal_failed[str(r.status_code)] += 1
        return r.status_code

    async def oversized(self, http: httpx.AsyncClient) -> int:
        r = await http.post("/v1/completions", content=self.rng.choice(self.too_big),
                            headers={"Content-Type": "application/json"})
        return r.status_code

    async def abandoned(self, http: httpx.AsyncClient) -> int:
        body = json.dumps({"prompt": [self._ids(16)], "n": 16, "max_tokens": 2000, "temperature": 1.0}).encode()
        await _raw(self.port, _post(body), hang_up_after=self.rng.uniform(0.2, 1.0))
        return 200  # nothing to read: counted under "sent" only

    async def malformed(self, http: httpx.AsyncClient) -> int | None:
        choice = self.rng.randrange(6)
        if choice == 0:
            return (await http.post("/v1/completions", content=b"{not json",
                                    headers={"Content-Type": "application/json"})).status_code
        if choice == 1:
            return (await http.post("/v1/completions", json={"prompt": [1, 2], "seed": 10**30})).status_code
        if choice == 2:
            return (await http.post("/v1/completions", json={"prompt": {"x": 1}, "n": -1})).status_code
        if choice == 3:
            return (await http.post("/v1/chat/completions", json={"messages": "hi"})).status_code
        if choice == 4:  # chunked framing that is not hex
            return await _raw(self.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                                         b"\r\n\r\nZZ\r\n{}\r\n0\r\n\r\n", None)
        return await _raw(self.port, b"GARBAGE / HTTP/9.9\r\n\r\n", None)


async def _run(args: argparse.Namespace, port: int, pid: int) -> dict[str, Any]:
    base = f"http://127.0.0.1:{port}"
    proc = psutil.Process(pid)
    rss = [proc.memory_info().rss]
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            try:
                rss.append(proc.memory_info().rss)
            except psutil.Error:
                return
            await asyncio.sleep(0.25)

    me = psutil.Process()
    cpu0 = sum(proc.cpu_times()[:2]), sum(me.cpu_times()[:2])
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=base, timeout=args.timeout, limits=limits) as http:
        load = Load(port, args.context, args.vocab, args.seed)
        sampler = asyncio.create_task(sample())
        t = time.monotonic()
        await asyncio.gather(*[load.client(http, t + args.seconds) for _ in range(args.clients)])
        wall = time.monotonic() - t
        healthy = (await http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})).status_code
        stop.set()
        await sampler
    cpu = sum(proc.cpu_times()[:2]) - cpu0[0], sum(me.cpu_times()[:2]) - cpu0[1]
    lat = sorted(load.latencies)

    def pct(q: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else None

    return {"clients": args.clients, "seconds": args.seconds, "wall_s": round(wall, 1),
            "normal_sent": load.sent["normal"], "normal_answered": load.normal_answered,
            "normal_failed": dict(load.normal_failed), "p50_s": pct(0.50), "p99_s": pct(0.99),
            "sent_by_kind": dict(load.sent),
            "errors_by_code": dict(Counter(k.split()[0] for k in load.codes.elements())),
            "errors_by_code_and_kind": dict(load.codes), "rss_start_mb": round(rss[0] / 2**20),
            "rss_peak_mb": round(max(rss) / 2**20), "answers_after": healthy,
            # where the time went: CPU seconds of the server process and of these clients over the run
            "server_cpu_s": round(cpu[0], 1), "client_cpu_s": round(cpu[1], 1),
            "client_exceptions": load.examples}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--model", default="tiny")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request client timeout (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="load a server already running at this loopback URL (its --model given too) "
                                 "with --pid its process id, instead of starting one")
    p.add_argument("--pid", type=int, default=0)
    args = p.parse_args()
    from agentrl.model_zoo import resolve_model

    cfg = json.loads((resolve_model(args.model) / "config.json").read_text())
    args.context, args.vocab = int(cfg.get("max_position_embeddings", 4096)), int(cfg["vocab_size"])
    if args.url:
        report = asyncio.run(_run(args, int(args.url.rsplit(":", 1)[1]), args.pid or os.getpid()))
        print(json.dumps(report), flush=True)
        return 0
    port = _free_port()
    log = tempfile.TemporaryFile("w+")  # the server's stderr (a pipe nobody reads would block it when full)
    server = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "serve", "--model", args.model,
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                print(f"error: the server did not come up: {log.read()[-2000:]}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        report = asyncio.run(_run(args, port, server.pid))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    log.seek(0)
    report["server_tracebacks"] = log.read().count("Traceback")
    print(json.dumps(report), flush=True)
    return 0 if report["normal_answered"] == report["normal_sent"] and report["answers_after"] == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
