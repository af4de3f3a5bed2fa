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


def test_the_servers_rounds_keep_to_the_row_and_kv_budgets_and_the_rest_opens_the_next_round():
    from agentrl.generation.server import BatchingWorker, _Job
    from agentrl.types import Completion, SamplingParams

    gate, calls = threading.Event(), []

    class Gen:  # a stand-in generator: records each call's rows; the first call waits until all are queued
        def generate(self, prompts, sampling, seeds=None, cancelled=None, **kw):
            calls.append(len(prompts))
            gate.wait(5)
            return [Completion([1], [0.0], "x", "stop") for _ in prompts]

    worker = BatchingWorker(Gen(), max_batch=3, max_batch_tokens=40)
    s = SamplingParams(max_new_tokens=8)
    futs = [worker.submit(_Job([[1, 2]], s))]  # the first round: this job alone, held at the gate
    while not calls:
        time.sleep(0.01)
    # 2 + 8 = 10 KV tokens a row: a round of 3 rows costs 30; the row budget cuts the 5 into 3 and 2
    futs += [worker.submit(_Job([[1, 2]], s)) for _ in range(5)]
    # one job of 4 rows (40 tokens) is over the row budget alone: it still runs, in a round of its own
    futs.append(worker.submit(_Job([[1, 2]] * 4, s)))
    gate.set()
    assert [len(f.result(10)) for f in futs] == [1] * 6 + [4]
    assert calls == [1, 3, 2, 4]
    worker.close()
