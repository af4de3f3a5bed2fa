"""What ``agentrl bench`` and ``agentrl bench sync`` both measure: the rollout engine against plain
batched generation of the same prompts."""
from __future__ import annotations

import time
from typing import Any


def engine_vs_raw(engine: Any, gen: Any, starts: list[Any], sampling: Any) -> tuple[int, float, int, float]:
    """(tokens, seconds) of ``engine`` rolling out ``starts``, then of the same prompts, turn by turn, as
    plain batched ``gen.generate`` calls."""
    t = time.perf_counter()
    episodes = engine.run(starts)
    engine_s = time.perf_counter() - t
    by_turn: dict[int, list[list[int]]] = {}
    for ep in episodes:
        for k, turn in enumerate(ep.turns):
            by_turn.setdefault(k, []).append(turn.prompt_ids)
    raw_tokens, t = 0, time.perf_counter()
    for k in sorted(by_turn):
        raw_tokens += sum(len(c.ids) for c in gen.generate(by_turn[k], sampling))
    return int(engine.stats["generated_tokens"]), engine_s, raw_tokens, time.perf_counter() - t
