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
