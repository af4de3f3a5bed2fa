"""In-flight weight updates on generation servers (``trainer.inflight_updates`` with vLLM): new weights go in
while requests run, and every token still says which version drew it.

vLLM cannot tell an OpenAI-API client which weights drew a token, so the update makes every response one
version: the client side counts its requests in flight behind a ``VersionGate``; an update closes the gate
(no new request starts), aborts what runs on the servers (vLLM's ``/pause?mode=abort`` then
``/abort_requests``: each aborted request returns its tokens so far with ``finish_reason="abort"``) until
nothing of ours is in flight, loads the weights, and reopens the gate at the new version. A response is then
wholly drawn by the version at which it entered the gate. ``generate_across_updates`` continues each aborted
row where it stopped: its prompt plus the tokens so far (token ids, never re-tokenized), the rest of its
token budget and of its answer choices, as a new request drawn by the new weights, which re-read the whole
prefix (the embedded generator keeps the old KV cache instead; AReaL and SkyRL also resubmit).

A stop string split by the update (``"</ans"`` before it, ``"wer>"`` after) would not be seen by the
continuation, which matches stop strings in its own text only: the rest of it (``"wer>"``) is added to the
continuation's stops. That rest could also end the continuation where the split string is not completed (a
``"wer>"`` later in the text); the row then ends there.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from agentrl.types import Completion, SamplingParams

ABORTED = "abort"  # vLLM's finish reason for a request aborted by a pause or /abort_requests


class VersionGate:
    """Requests enter at the current weights version and leave when answered; an update closes the gate,
    waits until none is in, and opens it at the next version."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self._cond = threading.Condition()
        self._open = True
        self._in = 0

    def enter(self) -> int:
        with self._cond:
            while not self._open:
                self._cond.wait()
            self._in += 1
            return self.version

    def leave(self) -> None:
        with self._cond:
            self._in -= 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._open = False

    def idle(self, timeout_s: float) -> bool:
        """Whether no request is in (waits up to ``timeout_s`` for the last to leave)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._in and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            return self._in == 0

    def open(self, version: int) -> None:
        with self._cond:
            self.version, self._open = version, True
            self._cond.notify_all()


@dataclasses.dataclass
class _Row:
    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    text: str = ""
    allowed: list[list[int]] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish: str = ""


Call = Callable[[list[list[int]], SamplingParams, "list[int] | None", "list[list[list[int]] | None] | None"],
                list[Completion]]


def generate_across_updates(call: Call, gate: VersionGate, prompts: list[list[int]], sampling: SamplingParams,
                            seeds: list[int] | None = None,
                            choices: list[list[list[int]] | None] | None = None) -> list[Completion]:
    """``call`` (the servers' ``generate``) through ``gate``: rows aborted by an update are continued at the next
    version until each stops or spends ``sampling.max_new_tokens``; ``Completion.versions`` gives each token's."""
    rows = [_Row() for _ in prompts]
    todo = list(range(len(prompts)))
    while todo:
        # one request per remaining budget and split stop: the first round is the whole call, continuations
        # are rare
        groups: dict[tuple[int, tuple[str, ...]], list[int]] = {}
        for i in todo:
            key = (sampling.max_new_tokens - len(rows[i].ids), _split_stops(sampling.stop, rows[i].text))
            groups.setdefault(key, []).append(i)

        def one(key: tuple[int, tuple[str, ...]], idx: list[int]) -> None:
            budget, rests = key
            left = [_continue_choices(choices[i], rows[i].ids) for i in idx] if choices is not None else None
            version = gate.enter()
            try:
                outs = call([prompts[i] + rows[i].ids for i in idx],
                            dataclasses.replace(sampling, max_new_tokens=budget, stop=[*sampling.stop, *rests]),
                            [seeds[i] for i in idx] if seeds is not None else None, left)
            finally:
                gate.leave()
            for i, out in zip(idx, outs):
                r = rows[i]
                r.ids += out.ids
                r.logprobs += out.logprobs
                r.text += out.text
                r.allowed += out.allowed
                r.versions += [version] * len(out.ids)
                if out.finish_reason != ABORTED:
                    r.finish = out.finish_reason
                elif len(r.ids) >= sampling.max_new_tokens:
                    r.finish = "length"
                elif choices is not None and _continue_choices(choices[i], r.ids) == []:
                    r.finish = "stop"  # the tokens so far are a whole answer and begin no longer one

        if len(groups) == 1:
            one(*next(iter(groups.items())))
        else:
            with ThreadPoolExecutor(max_workers=len(groups)) as pool:
                for f in [pool.submit(one, k, idx) for k, idx in groups.items()]:
                    f.result()
        todo = [i for i in todo if not rows[i].finish]
    return [Completion(r.ids, r.logprobs, r.text, r.finish, r.allowed, r.versions) for r in rows]


def _split_stops(stops: list[str], text: str) -> tuple[str, ...]:
    """The rest of each stop string whose beginning ends ``text`` (``"</ans"`` -> ``"wer>"``): the continuation
    stops on it too, as the row would have without the update."""
    return tuple(sorted({s[k:] for s in stops for k in range(1, len(s)) if text.endswith(s[:k])}))


def _continue_choices(choices: list[list[int]] | None, done: list[int]) -> list[list[int]] | None:
    """The rest of each answer that begins with the tokens drawn so far ([]: one of them is complete)."""
    if choices is None or not done:
        return choices
    return [c[len(done):] for c in choices if c[:len(done)] == done and len(c) > len(done)]
