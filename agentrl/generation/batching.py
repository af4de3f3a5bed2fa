"""The one request batcher: a queue whose consumers take a batch at a time.

A consumer blocks for one item, then takes every item that arrives while its ``wait`` policy still says to
wait and that ``fits`` the batch. An item that does not fit stays at the head of the queue and opens the
next batch (no consumer holds it privately, so another one may take it at once). Used by the rollout
scheduler (``generation/scheduler.py``: lanes of episode turns) and by ``agentrl serve``'s workers
(``generation/server.py``: rounds of HTTP requests under row and KV-cache budgets).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

# seconds to wait for one more item, given the batch so far and the seconds since its first item was taken
WaitPolicy = Callable[[list, float], float]
# whether an item may join the batch so far
FitPolicy = Callable[[list, object], bool]


class BatchQueue(Generic[T]):
    """Any thread ``put``s; any number of consumers ``take`` batches; ``close`` ends the takes once the
    queue is empty (what was put before still comes out)."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._cv = threading.Condition()
        self.closed = False

    def put(self, item: T) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify()

    def __len__(self) -> int:
        return len(self._items)

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()

    def drain(self) -> list[T]:
        """Everything still queued, taken at once (a closing consumer answers it)."""
        with self._cv:
            out = list(self._items)
            self._items.clear()
            return out

    def take(self, wait: WaitPolicy | None = None, fits: FitPolicy | None = None) -> list[T] | None:
        """One batch: blocks for its first item, then takes each item that fits while ``wait`` gives a
        positive time (0: only what is queued already). None once closed and empty."""
        with self._cv:
            while not self._items:
                if self.closed:
                    return None
                self._cv.wait()
            batch = [self._items.popleft()]
            start = time.monotonic()
            while True:
                if self._items:
                    if fits is not None and not fits(batch, self._items[0]):
                        break
                    batch.append(self._items.popleft())
                    continue
                left = 0.0 if self.closed or wait is None else wait(batch, time.monotonic() - start)
                if left <= 0:
                    break
                self._cv.wait(left)
            if self._items:  # what this batch left over may be another consumer's next batch
                self._cv.notify()
            return batch
