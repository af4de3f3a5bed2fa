"""The one request batcher (``agentrl.generation.batching``) under the rollout scheduler and the server."""
import threading
import time

from agentrl.generation.batching import BatchQueue


def test_a_batch_takes_what_waits_and_what_fits_and_the_rest_opens_the_next():
    q = BatchQueue()
    for x in (3, 4, 5, 1):
        q.put(x)
    fits = lambda batch, x: sum(batch) + x <= 8  # noqa: E731
    assert q.take(fits=fits) == [3, 4]  # 5 does not fit: it stays at the head
    assert q.take(fits=fits) == [5, 1]
    q.close()
    assert q.take() is None


def test_a_consumer_waits_as_its_policy_says_and_close_lets_queued_items_out():
    q = BatchQueue()
    q.put("a")
    threading.Timer(0.05, q.put, ["b"]).start()
    t = time.monotonic()
    assert q.take(wait=lambda batch, waited: 1.0 - waited if len(batch) < 2 else 0.0) == ["a", "b"]
    assert time.monotonic() - t < 0.9  # it stopped waiting once the batch was whole
    got = []
    idle = threading.Thread(target=lambda: got.append(q.take()))  # blocks on the empty queue
    idle.start()
    q.put("c")
    idle.join(5)
    assert got == [["c"]]
    q.put("d")
    q.close()  # what was queued still comes out; then every consumer is told it is over
    assert q.take() == ["d"] and q.take() is None
