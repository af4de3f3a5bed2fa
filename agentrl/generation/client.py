"""Remote generator: the ``Generator`` interface over HTTP, against ``agentrl serve`` or ``vllm serve``.

Both speak the OpenAI completions protocol with token-id prompts; generated token ids come back in
``token_ids`` (ours, and vLLM with ``return_token_ids``) or as ``token_id:N`` strings in
``logprobs.tokens`` (``return_tokens_as_token_ids``), so they are never re-tokenized from text.
Constrained decoding (``choices``, one list of answer token-id sequences per prompt): our server takes
them as ``choice_token_ids``; vLLM as ``vllm_xargs`` read by our logits processor
(``agentrl.generation.vllm_choices``, which ``VLLMServer`` loads). Either way the client walks each
completion down its choices to fill ``Completion.allowed`` (what the learner masks the vocabulary to), and
a completion that is not one of them is an error, never a silently unconstrained sample.
Weight sync: ``load_weights(folder)`` posts a saved HF folder to our server; against vLLM a LoRA adapter
is loaded through its ``/v1/load_lora_adapter`` route (full weights there mean restarting the server on
the new folder, which ``agentrl.generation.vllm.VLLMServer.restart`` does).
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agentrl import dist
from agentrl.generation.embedded import along_choices
from agentrl.types import Completion, SamplingParams

CHOICES_XARG = "agentrl_choices"  # the vllm_xargs key our vLLM logits processor reads (a JSON string)
BUSY_WAIT_S = 120.0  # how long a request waits out a busy server (429/503 with Retry-After) before failing
# A refused connection never delivered the request, so any call (a pause, a weight load) may be tried again:
# these pauses (3 s in all) ride out a listener's brief refusals, while a server that is gone still fails
# within seconds.
REFUSED_RETRY_S = (0.2, 0.4, 0.8, 1.6)


def _retry_after(e: urllib.error.HTTPError) -> float | None:
    """The server's Retry-After in seconds (at most 10), or None when it sent none."""
    try:
        return min(10.0, max(0.05, float(e.headers.get("Retry-After", ""))))
    except (TypeError, ValueError):
        return None


class GenerationServerError(RuntimeError):
    def __init__(self, message: str, status: int | None = None, refused_connection: bool = False):
        super().__init__(message)
        self.status = status  # the HTTP status when the server answered; None when it could not be reached
        self.refused_connection = refused_connection  # refused on every try (request() already waited it out)

    @property
    def refused(self) -> bool:
        """The server is up and rejected the request itself (4xx): retrying or another server will not help."""
        return self.status is not None and 400 <= self.status < 500


class RemoteGenerator:
    stages = False  # `agentrl serve` loads the weights the learner exports, its current ones
    version = 0  # no in-flight updates: it holds the weights of the last ``receive``
    inflight_loads = 0

    def __init__(self, base_url: str, model: str | None = None, timeout: float = 600.0, backend: str = "agentrl",
                 max_prompts_per_request: int = 64, parallel_requests: int = 4, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("AGENTRL_API_KEY")
        self.timeout, self.backend = timeout, backend
        self.max_prompts, self.parallel = max_prompts_per_request, parallel_requests
        self.model = model or self.models()[0]
        self.lora_name: str | None = None
        self._loads = 0  # adapters loaded: part of each adapter's name
        self.weights_dtype: Any = None  # a vLLM server's weights dtype once asked (vllm_sync.served_dtype)

    # ----- HTTP -------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One JSON call to the server (``path`` under its base URL): the decoded reply, or a one-line error."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        waited = 0.0
        refusals = list(REFUSED_RETRY_S)
        while True:
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    raw = resp.read()
                break
            except urllib.error.HTTPError as e:
                # 429: this client has too much queued on the server; 503: its connections are full. Both pass.
                pause = _retry_after(e)
                if e.code in (429, 503) and pause is not None and waited + pause <= min(self.timeout, BUSY_WAIT_S):
                    time.sleep(pause)
                    waited += pause
                    continue
                raise GenerationServerError(f"{method} {path}: HTTP {e.code}: "
                                            f"{e.read().decode(errors='replace')[:500]}", e.code) from None
            except urllib.error.URLError as e:
                gone = isinstance(e.reason, ConnectionRefusedError)
                if gone and refusals:
                    time.sleep(refusals.pop(0))
                    continue
                tries = f", {len(REFUSED_RETRY_S) + 1} tries" if gone else ""
                raise GenerationServerError(f"{method} {path}: cannot reach {self.base_url} ({e.reason}{tries})",
                                            refused_connection=gone) from None
            except (http.client.HTTPException, OSError) as e:
                # the connection broke after the request went out (a server killed mid-request resets it): the
                # server's error, so that the pool drops it like one it cannot reach, not this rank's crash
                raise GenerationServerError(f"{method} {path}: {self.base_url} broke the connection "
                                            f"({type(e).__name__}: {e})") from None
        if not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except json.JSONDecodeError:  # some vLLM routes answer plain text ("Success: LoRA adapter ... added")
            return {"text": raw.decode(errors="replace")}

    def models(self) -> list[str]:
        return [m["id"] for m in self.request("GET", "/v1/models")["data"]]

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.request("GET", "/health")
                return
            except GenerationServerError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    # ----- Generator --------------------------------------------------------------------------
    def _body(self, prompts: list[list[int]], sampling: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = dict(model=self.lora_name or self.model, prompt=prompts,
                                    max_tokens=sampling.max_new_tokens,
                                    temperature=sampling.temperature, top_p=sampling.top_p, logprobs=0,
                                    stop=sampling.stop or None, return_tokens_as_token_ids=True)
        # vLLM seeds every prompt of a request with the request's seed, so the G identical prompts of a
        # group would come back as G identical samples; our server draws one stream across the rows.
        if sampling.seed is not None and self.backend != "vllm":
            body["seed"] = sampling.seed
        if self.backend == "vllm":
            # vLLM extras: keep stop strings in the text (our parser expects the closing tag), and ids.
            body.update(include_stop_str_in_output=True, return_token_ids=True, skip_special_tokens=True)
        return body

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seeds: list[int] | None = None,
                 choices: list[list[list[int]] | None] | None = None) -> list[Completion]:
        """``choices``: per prompt, the token-id sequences its completion must be one of (None: free)."""
        if choices is not None and len(choices) != len(prompts):
            raise ValueError(f"{len(choices)} choice lists for {len(prompts)} prompts")
        if choices is not None and all(c is None for c in choices):
            choices = None
        # vLLM seeds every prompt of a request alike, and takes its extension arguments per request: per-row
        # seeds or choices mean one request per prompt (vLLM batches concurrent requests itself); our
        # server takes a list with one seed and one choice list per prompt.
        per_row = (seeds is not None or choices is not None) and self.backend == "vllm"
        size = 1 if per_row else self.max_prompts
        starts = list(range(0, len(prompts), size))
        chunks = [prompts[i:i + size] for i in starts]

        def body(i: int, chunk: list[list[int]]) -> dict[str, Any]:
            b = self._body(chunk, sampling)
            if seeds is not None:
                b["seed"] = int(seeds[i]) if per_row else [int(x) for x in seeds[i:i + len(chunk)]]
            if choices is not None and self.backend == "vllm":
                if choices[i] is not None:
                    b["vllm_xargs"] = {CHOICES_XARG: json.dumps(choices[i])}
            elif choices is not None:
                b["choice_token_ids"] = choices[i:i + len(chunk)]
            return b

        def post(ic: tuple[int, list[list[int]]]) -> dict[str, Any]:
            return self.request("POST", "/v1/completions", body(*ic))

        if len(chunks) == 1:  # the per-trajectory loop's single-row calls: no thread to start for one request
            replies = [post((starts[0], chunks[0]))]
        else:
            workers = self.parallel * 16 if per_row else self.parallel
            with ThreadPoolExecutor(max_workers=max(1, min(workers, len(chunks)))) as pool:
                replies = list(pool.map(post, zip(starts, chunks)))
        out: list[Completion] = []
        for chunk, reply in zip(chunks, replies):
            replies_choices = sorted(reply["choices"], key=lambda c: c["index"])
            if len(replies_choices) != len(chunk):
                raise GenerationServerError(f"asked for {len(chunk)} completions, got {len(replies_choices)}")
            out += [self._completion(c) for c in replies_choices]
        if choices is not None:
            for k, (c, allowed) in enumerate(zip(out, choices)):
                if allowed is not None:
                    c.allowed = self._allowed(c.ids, allowed, k)
        return out

    def _allowed(self, ids: list[int], choices: list[list[int]], row: int) -> list[list[int]]:
        """The ids each token of a constrained completion was drawn among; a trailing token after a whole
        answer (a server that ends on an end-of-sequence token) was the only one allowed there."""
        walk = along_choices(ids, choices)
        if walk is None and len(ids) > 1:
            head = along_choices(ids[:-1], choices)
            walk = None if head is None else head + [[ids[-1]]]
        if walk is None:
            hint = (" (start vLLM with --logits-processors agentrl.generation.vllm_choices:ChoiceLogits, as "
                    "VLLMServer does)" if self.backend == "vllm" else "")
            raise GenerationServerError(f"completion {row} is not one of the {len(choices)} answers it was "
                                        f"constrained to: the server did not constrain decoding{hint}", 400)
        return walk

    @staticmethod
    def _completion(choice: dict[str, Any]) -> Completion:
        lp = choice.get("logprobs") or {}
        ids = choice.get("token_ids")
        if ids is None:
            tokens = lp.get("tokens") or []
            if not all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
                raise GenerationServerError("server returned no token ids (needs return_tokens_as_token_ids)")
            ids = [int(t.split(":", 1)[1]) for t in tokens]
        logprobs = [float(x) for x in (lp.get("token_logprobs") or [])]
        if len(logprobs) != len(ids):
            raise GenerationServerError(f"{len(ids)} token ids but {len(logprobs)} log-probs")
        return Completion(list(ids), logprobs, choice.get("text", ""), choice.get("finish_reason") or "length")

    def score(self, ids: list[int]) -> list[float]:
        """Server-side log-probs of ``ids[1:]`` given their prefixes (echo), for checking a weight sync."""
        reply = self.request("POST", "/v1/completions", dict(model=self.lora_name or self.model, prompt=[ids],
                                                               max_tokens=0 if self.backend != "vllm" else 1,
                                                               echo=True, logprobs=0, temperature=1.0,
                                                               return_tokens_as_token_ids=True))
        lps = reply["choices"][0]["logprobs"]["token_logprobs"]
        return [float(x) for x in lps[1:len(ids)]]

    def collective_rpc(self, method: str, args: list[str]) -> Any:
        """Call ``method`` on every worker of a vLLM server (needs VLLM_SERVER_DEV_MODE=1 there)."""
        return self.request("POST", "/collective_rpc", {"method": method, "args": args})

    def reset_prefix_cache(self) -> None:
        if self.backend == "vllm":
            self.request("POST", "/reset_prefix_cache")

    def receive(self, engine: Any, staging: Path) -> dict[str, float]:
        """``agentrl serve``: the engine exports an HF folder (collectively; rank 0 writes it) and rank 0
        asks the server to load it (the server must allow ``staging``: ``--allow-weights-dir``)."""
        t = time.perf_counter()
        folder = Path(staging) / "weights"
        if dist.is_main() and folder.exists():
            shutil.rmtree(folder)
        dist.barrier()
        engine.export_weights(folder)
        if dist.is_main():
            self.load_weights(folder)
        dist.barrier()
        return dict(time_sync_s=time.perf_counter() - t)

    def release(self) -> bool:
        return False  # holds nothing an update could use

    def context_length(self) -> int | None:
        """The ``max_model_len`` the server's ``/v1/models`` reports for the model asked for (vLLM's, and
        ``agentrl serve``'s); asked once."""
        if not hasattr(self, "_context"):
            self._context: int | None = None
            for m in self.request("GET", "/v1/models").get("data", []):
                if m.get("max_model_len") and m.get("id") in (self.model, self.lora_name):
                    self._context = int(m["max_model_len"])
                    break
        return self._context

    # the weights of `agentrl serve` are its exported folder: no staged copies, no in-flight updates (the
    # config loader refuses what would need them)
    def stage(self, engine: Any) -> Any:
        raise NotImplementedError("`agentrl serve` loads exported weights; it takes no staged copies")

    def set_inflight(self, on: bool) -> None:
        if on:
            raise NotImplementedError("`agentrl serve` takes no weights mid-generation")

    def offer(self, version: int, weights: Any) -> None:
        raise NotImplementedError("`agentrl serve` takes no weights mid-generation")

    def set_version(self, version: int) -> None:
        pass

    def close(self) -> None:
        pass

    def load_weights(self, source: Any, lora: bool = False) -> None:
        if lora:
            # unique per load: two loads within a millisecond, or two trainers on one server, never share a name
            self._loads += 1
            name = f"policy-{os.getpid()}-{time.time_ns()}-{self._loads}"
            self.request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(source)})
            self.lora_name = name
            return
        if self.backend == "vllm":
            raise GenerationServerError("vLLM has no full-weight reload route: restart it on the new folder "
                                        "(VLLMServer.restart) or sync a LoRA adapter")
        self.request("POST", "/load_weights", {"path": str(source)})


def check_sync(client: RemoteGenerator, model: Any, ids: list[int], atol: float = 1e-3) -> float:
    """Max |server log-prob - learner log-prob| over a fixed sequence; raises if above ``atol``."""
    import torch

    from agentrl.learner.logprobs import token_logprobs

    t = torch.tensor([ids])
    with torch.no_grad():
        ref = token_logprobs(model, t, torch.ones_like(t))[0].tolist()
    got = client.score(ids)
    diff = max(abs(a - b) for a, b in zip(ref, got))
    if diff > atol:
        raise GenerationServerError(f"weight sync check failed: server and learner log-probs differ by {diff:.2e}")
    return diff
