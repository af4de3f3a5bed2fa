"""The prompt prefix a batch of token rows shares (an agent's system prompt and task rules): the
generator's prefill and the learner's forward both run it once for all rows."""
from __future__ import annotations

from typing import Sequence

# below this many shared tokens a separate prefix pass is not worth its call
MIN_SHARED_PREFIX = 16


def shared_prefix_len(rows: Sequence[Sequence[int]], minimum: int = MIN_SHARED_PREFIX) -> int:
    """Leading tokens every row has in common, leaving each row at least one token of its own; 0 for a
    single row or fewer than ``minimum`` shared tokens."""
    if len(rows) < 2:
        return 0
    first, limit = rows[0], min(len(r) for r in rows) - 1
    n = 0
    while n < limit and all(r[n] == first[n] for r in rows):
        n += 1
    return n if n >= minimum else 0


def prefix_levels(rows: Sequence[Sequence[int]], width: int, level_cost: int = MIN_SHARED_PREFIX
                  ) -> list[tuple[int, list[int]]]:
    """How a forward pass over ``rows`` (their real tokens; padded to ``width``) runs the leading tokens rows
    share once per distinct prefix: passes ``(end, group of each row)``, each over the distinct rows' tokens
    from the previous pass's end to ``end``, before one pass of every row over the rest. GRPO's groups repeat
    a whole prompt (8 prompts x 4 completions: the prompt is 3/4 of every row): the batch's common system
    prompt runs once, each prompt's own part once per prompt, only the completions per row.

    The passes minimize the token positions computed, each pass counted ``level_cost`` more (its call);
    every row keeps at least one token for the last pass. [] when no pass saves anything."""
    B = len(rows)
    cap = min((len(r) for r in rows), default=0) - 1
    if B < 2 or cap < 1:
        return []
    order = sorted(range(B), key=lambda i: list(rows[i][:cap]))
    lcp = []  # common leading tokens of neighbours in sorted order: rows sharing m tokens are contiguous
    for a, b in zip(order, order[1:]):
        x, y, n = rows[a], rows[b], 0
        while n < cap and x[n] == y[n]:
            n += 1
        lcp.append(n)
    ends = sorted({n for n in lcp if n > 0} | {cap})
    groups = [1 + sum(n < m for n in lcp) for m in ends]  # distinct prefixes of length m
    # cost[j]: the cheapest passes ending at ends[j]; back[j]: the pass before it (-1: none)
    cost, back = [], []
    for j, m in enumerate(ends):
        options = [(groups[j] * m, -1)] + [(cost[i] + groups[j] * (m - ends[i]), i) for i in range(j)]
        c, i = min(options)
        cost.append(c + level_cost)
        back.append(i)
    total, j = min((c + B * (width - ends[j]), j) for j, c in enumerate(cost))
    if total >= B * width:
        return []
    chosen = []
    while j >= 0:
        chosen.append(ends[j])
        j = back[j]
    out = []
    for m in reversed(chosen):
        gid, g = [0] * B, 0
        for k, i in enumerate(order):
            if k and lcp[k - 1] < m:
                g += 1
            gid[i] = g
        out.append((m, gid))
    return out
