"""What a client may ask ``agentrl serve``: every field of a completions request checked (type, range,
size) before it reaches the batching worker. A bad field is a ``ValueError`` naming it (HTTP 400)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentrl.types import SamplingParams

MAX_BODY_BYTES = 8 << 20  # a request body beyond this is refused (413) before it is read
MAX_PROMPTS = 1024  # prompts x n per request
MAX_N = 64
MAX_STOP = 16  # stop strings per request, each at most MAX_STOP_CHARS
MAX_STOP_CHARS = 256
MAX_CHOICES = 1024  # answers per prompt under ``choice_token_ids``


@dataclass
class CompletionRequest:
    prompts: list[list[int]]
    n: int
    sampling: SamplingParams
    seeds: list[int] | None  # one per prompt (then sampling.seed is None)
    echo: bool
    logprobs: bool
    as_ids: bool
    # our extension: per prompt, the token-id sequences its completion must be one of (None: free)
    choices: list[list[list[int]] | None] | None = None


def _int(body: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = body.get(key, default)
    if v is None:
        v = default
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"'{key}' must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _float(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        v = default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"'{key}' must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


def _prompts(prompt: Any, tokenizer: Any, vocab: int, context: int) -> list[list[int]]:
    def ids_of(text: str) -> list[int]:
        if len(text) > 8 * context:  # no tokenizer call on a 10 MB string: it cannot fit anyway
            raise ValueError(f"'prompt' is longer than the model's context ({context} tokens)")
        return tokenizer(text)["input_ids"]

    if isinstance(prompt, str):
        out = [ids_of(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        out = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        if not all(isinstance(x, int) and not isinstance(x, bool) for p in prompt for x in p):
            raise ValueError("'prompt' as a list of lists must hold token ids (integers)")
        out = [list(p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        out = [ids_of(p) for p in prompt]
    else:
        raise ValueError("prompt must be a string, a list of token ids, or a list of either")
    if len(out) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(out)}")
    for p in out:
        if not p:
            raise ValueError("a prompt is empty")
        bad = next((x for x in p if not 0 <= x < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
    return out


def _choices(body: dict[str, Any], prompts: int, vocab: int, max_tokens: int) -> list[list[list[int]] | None] | None:
    """``choice_token_ids``: null, or one entry per prompt, each null (free decoding) or a list of
    non-empty token-id lists no longer than ``max_tokens`` (an answer that could not be finished)."""
    raw = body.get("choice_token_ids")
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != prompts:
        raise ValueError(f"'choice_token_ids' must be a list with one entry per prompt ({prompts}), each null or "
                         "a list of token-id lists")
    out: list[list[list[int]] | None] = []
    for entry in raw:
        if entry is None:
            out.append(None)
            continue
        if not isinstance(entry, list) or not entry or len(entry) > MAX_CHOICES or not all(
                isinstance(c, list) and 0 < len(c) <= max_tokens and all(
                    isinstance(x, int) and not isinstance(x, bool) and 0 <= x < vocab for x in c) for c in entry):
            raise ValueError(f"'choice_token_ids': each prompt's entry must be null or 1-{MAX_CHOICES} lists of "
                             f"1-{max_tokens} token ids (max_tokens) in [0, {vocab})")
        out.append([list(c) for c in entry])
    return out


def parse_completion(body: Any, tokenizer: Any, vocab: int, context: int) -> CompletionRequest:
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    prompts = _prompts(body.get("prompt"), tokenizer, vocab, context)
    n = _int(body, "n", 1, 1, MAX_N)
    if len(prompts) * n > MAX_PROMPTS:
        raise ValueError(f"prompts x n = {len(prompts) * n} is more than {MAX_PROMPTS} completions per request")
    longest = max(len(p) for p in prompts)
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise ValueError(f"'echo' must be true or false, got {echo!r}")
    # echo scores the prompt (a weight check): it may ask for no new tokens
    max_tokens = _int(body, "max_tokens", 16, 0 if echo else 1, max(1, context - longest))
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop) \
            or len(stop) > MAX_STOP:
        raise ValueError(f"'stop' must be a string or a list of at most {MAX_STOP} non-empty strings of at most "
                         f"{MAX_STOP_CHARS} characters")
    seed, seeds = body.get("seed"), None
    if isinstance(seed, list):
        if n != 1 or len(seed) != len(prompts) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                           for x in seed):
            raise ValueError("seed as a list needs n=1 and one integer per prompt")
        seed, seeds = None, [int(x) for x in seed]
    elif seed is not None:
        seed = _int(body, "seed", 0, -(2**63), 2**63 - 1)
    sampling = SamplingParams(temperature=_float(body, "temperature", 1.0, 0.0, 100.0),
                              top_p=_float(body, "top_p", 1.0, 1e-9, 1.0), max_new_tokens=max_tokens, stop=list(stop),
                              seed=seed)
    return CompletionRequest(prompts, n, sampling, seeds, echo, body.get("logprobs") is not None,
                             bool(body.get("return_tokens_as_token_ids", True)),
                             _choices(body, len(prompts), vocab, max_tokens))
