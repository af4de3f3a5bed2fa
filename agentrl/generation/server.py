"""`agentrl serve`: an HTTP generation server speaking the OpenAI completions protocol.

The subset ``vllm serve`` also speaks, so one client drives both: ``POST /v1/completions`` with token-id
prompts (a list of ints, or a list of lists), ``max_tokens``, ``temperature``, ``top_p``, ``n``, ``seed``
(one int for the request, or, our extension, a list with one per prompt: each row then samples from its
own stream, the same tokens whatever it is batched with),
``stop``, ``logprobs`` and ``echo`` (prompt log-probs, for checking weights), ``choice_token_ids`` (our
extension: per prompt, the token-id sequences its completion must be one of, or null; each token is then
drawn among the ids that continue one, and its log-prob is under that distribution), returning token ids
(``token_ids``, and ``logprobs.tokens`` as ``token_id:N`` like vLLM's ``return_tokens_as_token_ids``).
Plus ``POST /v1/chat/completions`` (messages through the model's chat template), ``POST /load_weights
{"path": HF folder}`` after a learner update (only under ``--allow-weights-dir``, architecture and every
tensor checked first), ``GET /v1/models``, ``GET /health``. Every field is validated
(``agentrl.generation.requests``): a bad request is a 400 naming the field, never a dead worker.
``--api-key`` / ``AGENTRL_API_KEY`` guards every route but ``/health``.

Concurrent requests are batched: a single worker thread takes everything queued (waiting a few ms for
stragglers), runs one batched ``generate`` per distinct sampling setting, and answers each request.
Binds 127.0.0.1 unless told otherwise.
"""
from __future__ import annotations

import hmac
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from agentrl.generation.base import chat_ids
from agentrl.generation.embedded import EmbeddedGenerator
from agentrl.generation.requests import MAX_BODY_BYTES, parse_completion
from agentrl.generation.weights_check import WeightsRefused, allowed_folder, load_into, read_checked
from agentrl.learner.logprobs import token_logprobs
from agentrl.types import SamplingParams


@dataclass
class _Job:
    prompts: list[list[int]]
    sampling: SamplingParams
    seeds: list[int] | None = None  # one per prompt (then ``sampling.seed`` is None)
    choices: list[list[list[int]] | None] | None = None  # one per prompt: its answers (None: free)
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
            raise (ValueError if getattr(job, "bad_request", False) else RuntimeError)(job.error)
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
        try:
            self._run_jobs(jobs)
        except Exception as e:  # whatever a request did, the worker lives on and every caller is answered
            for job in jobs:
                if not job.done.is_set():
                    job.error = f"{type(e).__name__}: {e}"
                    job.done.set()

    def _run_jobs(self, jobs: list[Any]) -> None:
        groups: dict[Any, list[_Job]] = {}
        for job in jobs:
            if not isinstance(job, _Job):  # a callable: weight load or scoring, run alone, in order
                try:
                    job.result = job.fn()
                except ValueError as e:  # the caller's fault (a 400), re-raised as is in ``submit``
                    job.error, job.bad_request = str(e), True
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
            # constrained and free rows batch together: the generator takes a choice list per row
            choices = [c for j in group for c in (j.choices or [None] * len(j.prompts))]
            extra = {"choices": choices} if any(c is not None for c in choices) else {}
            try:
                outs = self.gen.generate(prompts, group[0].sampling, seeds=seeds, **extra)
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
    bad_request: bool = False


class GenerationService:
    def __init__(self, generator: EmbeddedGenerator, model_name: str, allow_weights_dirs: list[str] | None = None):
        self.gen, self.model_name = generator, model_name
        self.allow = [Path(d).expanduser().resolve() for d in (allow_weights_dirs or [])]
        self.worker = BatchingWorker(generator)
        cfg = generator.model.config
        self.vocab = int(cfg.vocab_size)
        self.context = int(getattr(cfg, "max_position_embeddings", 0) or 4096)

    def completions(self, body: Any) -> dict[str, Any]:
        r = parse_completion(body, self.gen.tokenizer, self.vocab, self.context)
        choices: list[dict[str, Any]] = []
        usage = {"prompt_tokens": sum(len(p) for p in r.prompts) * r.n, "completion_tokens": 0}
        if r.echo:
            scores = self.worker.submit(_Call(lambda: self._score(r.prompts)))
            for i, (p, lp) in enumerate(zip(r.prompts, scores)):
                choices.append(dict(index=i, text="", finish_reason="length", token_ids=[], prompt_token_ids=p,
                                    logprobs=dict(tokens=[f"token_id:{t}" for t in p], token_logprobs=[None] + lp,
                                                  top_logprobs=None, text_offset=[])))
            return self._response(choices, usage)
        expanded = [p for p in r.prompts for _ in range(r.n)]
        answers = None if r.choices is None else [c for c in r.choices for _ in range(r.n)]
        outs = self.worker.submit(_Job(expanded, r.sampling, r.seeds, answers))
        for i, c in enumerate(outs):
            usage["completion_tokens"] += len(c.ids)
            tokens = [f"token_id:{t}" for t in c.ids] if r.as_ids else [self.gen.tokenizer.decode([t]) for t in c.ids]
            choices.append(dict(index=i, text=c.text, finish_reason=c.finish_reason, token_ids=c.ids,
                                logprobs=dict(tokens=tokens, token_logprobs=c.logprobs, top_logprobs=None,
                                              text_offset=[]) if r.logprobs else None))
        return self._response(choices, usage)

    def chat_completions(self, body: Any) -> dict[str, Any]:
        """``/v1/chat/completions``: the messages through the model's chat template, then a completion."""
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise ValueError("'messages' must be a non-empty list of {role, content} strings")
        if sum(len(m["content"]) for m in msgs) > 8 * self.context:
            raise ValueError(f"'messages' are longer than the model's context ({self.context} tokens)")
        ids = chat_ids(self.gen.tokenizer, [{"role": m["role"], "content": m["content"]} for m in msgs])
        out = self.completions({k: v for k, v in body.items() if k != "messages"} | {"prompt": ids})
        out["object"] = "chat.completion"
        out["choices"] = [dict(index=c["index"], finish_reason=c["finish_reason"],
                               message={"role": "assistant", "content": c["text"]}) for c in out["choices"]]
        return out

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

    def load_weights(self, path: Any) -> dict[str, Any]:
        """Only a folder under ``--allow-weights-dir``, of the served architecture with every tensor the
        model has (names and shapes), checked before the swap; never a download."""
        folder = allowed_folder(path, self.allow)
        model = self.gen.model

        def swap() -> None:
            load_into(model, read_checked(folder, model))

        self.worker.submit(_Call(swap))
        return {"status": "ok", "loaded": str(folder)}


def make_handler(service: GenerationService, api_key: str | None = None) -> type[BaseHTTPRequestHandler]:
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

        def _error(self, code: int, message: str, kind: str = "invalid_request_error") -> None:
            self._send(code, {"error": {"message": message, "type": kind}})

        def _authorized(self) -> bool:
            if not api_key or self.path == "/health":
                return True
            if hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {api_key}"):
                return True
            self._error(401, "missing or wrong API key (Authorization: Bearer KEY)", "authentication_error")
            return False

        def do_GET(self) -> None:  # noqa: N802
            if not self._authorized():
                return
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": service.model_name, "object": "model"}]})
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self) -> None:  # noqa: N802
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY_BYTES:
                self.close_connection = True
                return self._error(413, f"the request body must be at most {MAX_BODY_BYTES} bytes")
            raw = self.rfile.read(length)
            if not self._authorized():
                return
            try:
                body = json.loads(raw or b"{}")
                if self.path == "/v1/completions":
                    self._send(200, service.completions(body))
                elif self.path == "/v1/chat/completions":
                    self._send(200, service.chat_completions(body))
                elif self.path == "/load_weights":
                    if not isinstance(body, dict):
                        raise ValueError("the request body must be a JSON object")
                    self._send(200, service.load_weights(body.get("path")))
                else:
                    self._error(404, f"no route {self.path}")
            except WeightsRefused as e:
                self._error(403, str(e), "permission_error")
            except (ValueError, KeyError, TypeError) as e:
                self._error(400, f"bad request: {e}")
            except Exception as e:
                self._error(500, f"{type(e).__name__}: {e}", "server_error")

    return Handler


def start_server(generator: EmbeddedGenerator, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                 allow_weights_dirs: list[str] | None = None, api_key: str | None = None) -> ThreadingHTTPServer:
    """Start serving in a background thread; returns the server (``server.server_address`` has the port).
    ``allow_weights_dirs``: where ``/load_weights`` may read (none: it refuses every path); ``api_key``:
    required as ``Authorization: Bearer KEY`` on every route but ``/health``."""
    service = GenerationService(generator, model_name, allow_weights_dirs)
    server = ThreadingHTTPServer((host, port), make_handler(service, api_key))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="agentrl-http").start()
    return server
