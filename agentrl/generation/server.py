"""`agentrl serve`: an HTTP generation server speaking the OpenAI completions protocol.

The subset ``vllm serve`` also speaks, so one client drives both: ``POST /v1/completions`` with token-id
prompts (a list of ints, or a list of lists), ``max_tokens``, ``temperature``, ``top_p``, ``n``, ``seed``
(one int for the request, or, our extension, a list with one per prompt: each row then samples from its
own stream, the same tokens whatever it is batched with),
``stop``, ``logprobs`` and ``echo`` (prompt log-probs, for checking weights), returning token ids
(``token_ids``, and ``logprobs.tokens`` as ``token_id:N`` like vLLM's ``return_tokens_as_token_ids``).
Plus ``POST /load_weights {"path": HF folder}`` after a learner update, ``GET /v1/models``, ``GET /health``.

Concurrent requests are batched: a single worker thread takes everything queued (waiting a few ms for
stragglers), runs one batched ``generate`` per distinct sampling setting, and answers each request.
Binds 127.0.0.1 unless told otherwise.
"""
from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from agentrl.generation.embedded import EmbeddedGenerator
from agentrl.learner.logprobs import token_logprobs
from agentrl.types import SamplingParams


@dataclass
class _Job:
    prompts: list[list[int]]
    sampling: SamplingParams
    seeds: list[int] | None = None  # one per prompt (then ``sampling.seed`` is None)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: str = ""


class BatchingWorker:
    """Owns the model: generation and weight loads run on this one thread, never concurrently."""

    def __init__(self, generator: EmbeddedGenerator, max_wait_s: float = 0.005, max_batch: int = 256):
        self.gen, self.max_wait_s, self.max_batch = generator, max_wait_s, max_batch
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="agentrl-generate")
        self.thread.start()

    def submit(self, job: Any) -> Any:
        self.q.put(job)
        job.done.wait()
        if job.error:
            raise RuntimeError(job.error)
        return job.result

    def _loop(self) -> None:
        while True:
            jobs = [self.q.get()]
            deadline = time.monotonic() + self.max_wait_s
            while sum(len(j.prompts) for j in jobs if isinstance(j, _Job)) < self.max_batch:
                try:
                    jobs.append(self.q.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            self._run(jobs)

    def _run(self, jobs: list[Any]) -> None:
        groups: dict[Any, list[_Job]] = {}
        for job in jobs:
            if not isinstance(job, _Job):  # a callable: weight load or scoring, run alone, in order
                try:
                    job.result = job.fn()
                except Exception as e:  # reported to the caller, the server keeps serving
                    job.error = f"{type(e).__name__}: {e}"
                job.done.set()
                continue
            s = job.sampling
            # Requests with one seed run alone so their draws do not depend on what they were batched with;
            # per-row seeds batch freely (each row draws from its own stream).
            key = (s.temperature, s.top_p, s.max_new_tokens, tuple(s.stop), s.seed, job.seeds is not None,
                   id(job) if s.seed is not None else 0)
            groups.setdefault(key, []).append(job)
        for group in groups.values():
            prompts = [p for j in group for p in j.prompts]
            seeds = [x for j in group for x in j.seeds] if group[0].seeds is not None else None
            try:
                outs = self.gen.generate(prompts, group[0].sampling, seeds=seeds)
            except Exception as e:
                for j in group:
                    j.error = f"{type(e).__name__}: {e}"
                    j.done.set()
                continue
            k = 0
            for j in group:
                j.result, k = outs[k:k + len(j.prompts)], k + len(j.prompts)
                j.done.set()


@dataclass
class _Call:
    fn: Any
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: str = ""


def _as_prompts(prompt: Any, tokenizer: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenizer(prompt)["input_ids"]]
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
        return [prompt]
    if isinstance(prompt, list) and all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return [tokenizer(p)["input_ids"] for p in prompt]
    raise ValueError("prompt must be a string, a list of token ids, or a list of either")


class GenerationService:
    def __init__(self, generator: EmbeddedGenerator, model_name: str):
        self.gen, self.model_name = generator, model_name
        self.worker = BatchingWorker(generator)

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        prompts = _as_prompts(body.get("prompt"), self.gen.tokenizer)
        n = int(body.get("n", 1))
        max_tokens = int(body.get("max_tokens", 16))
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        choices: list[dict[str, Any]] = []
        usage = {"prompt_tokens": sum(len(p) for p in prompts) * n, "completion_tokens": 0}
        as_ids = bool(body.get("return_tokens_as_token_ids", True))
        if body.get("echo"):
            scores = self.worker.submit(_Call(lambda: self._score(prompts)))
            for i, (p, lp) in enumerate(zip(prompts, scores)):
                choices.append(dict(index=i, text="", finish_reason="length", token_ids=[], prompt_token_ids=p,
                                    logprobs=dict(tokens=[f"token_id:{t}" for t in p], token_logprobs=[None] + lp,
                                                  top_logprobs=None, text_offset=[])))
            return self._response(choices, usage)
        seed, seeds = body.get("seed"), None
        if isinstance(seed, list):
            if n != 1 or len(seed) != len(prompts) or not all(isinstance(x, int) for x in seed):
                raise ValueError("seed as a list needs n=1 and one integer per prompt")
            seed, seeds = None, [int(x) for x in seed]
        sampling = SamplingParams(temperature=float(body.get("temperature", 1.0)), top_p=float(body.get("top_p", 1.0)),
                                  max_new_tokens=max_tokens, stop=stop, seed=None if seed is None else int(seed))
        expanded = [p for p in prompts for _ in range(n)]
        outs = self.worker.submit(_Job(expanded, sampling, seeds))
        for i, c in enumerate(outs):
            usage["completion_tokens"] += len(c.ids)
            tokens = [f"token_id:{t}" for t in c.ids] if as_ids else [self.gen.tokenizer.decode([t]) for t in c.ids]
            choices.append(dict(index=i, text=c.text, finish_reason=c.finish_reason, token_ids=c.ids,
                                logprobs=dict(tokens=tokens, token_logprobs=c.logprobs, top_logprobs=None,
                                              text_offset=[]) if body.get("logprobs") is not None else None))
        return self._response(choices, usage)

    def _response(self, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {"id": f"cmpl-{uuid.uuid4().hex[:16]}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": usage}

    @torch.inference_mode()
    def _score(self, prompts: list[list[int]]) -> list[list[float]]:
        out = []
        for p in prompts:
            ids = torch.tensor([p])
            out.append(token_logprobs(self.gen.model, ids, torch.ones_like(ids))[0].tolist())
        return out

    def load_weights(self, path: str) -> dict[str, Any]:
        self.worker.submit(_Call(lambda: self.gen.load_weights(path)))
        return {"status": "ok", "loaded": path}


def make_handler(service: GenerationService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet by default; errors still answer
            pass

        def _send(self, code: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": service.model_name, "object": "model"}]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:  # noqa: N802
            try:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path == "/v1/completions":
                    self._send(200, service.completions(body))
                elif self.path == "/load_weights":
                    self._send(200, service.load_weights(body["path"]))
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
            except (ValueError, KeyError, TypeError) as e:
                self._send(400, {"error": {"message": f"bad request: {e}", "type": "invalid_request_error"}})
            except Exception as e:
                self._send(500, {"error": {"message": f"{type(e).__name__}: {e}"}})

    return Handler


def start_server(generator: EmbeddedGenerator, model_name: str, host: str = "127.0.0.1", port: int = 8000
                 ) -> ThreadingHTTPServer:
    """Start serving in a background thread; returns the server (``server.server_address`` has the port)."""
    server = ThreadingHTTPServer((host, port), make_handler(GenerationService(generator, model_name)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="agentrl-http").start()
    return server
