"""Per-trajectory rollouts (rollout.mode: async): the same episodes as lockstep, the latency env, the
generation scheduler's batching, the non-blocking env-slot API and `agentrl bench async`."""
import math
import threading
import time

import pytest

from agentrl.envs import make
from agentrl.envs.base import EnvError
from agentrl.envs.pool import EnvPool, InProcessEnvs
from agentrl.envs.replay import record
from agentrl.envs.slots import AsyncEnvSlots, as_async
from agentrl.generation.scheduler import BatchingScheduler
from agentrl.rollout.engine import RolloutConfig, RolloutEngine, Start
from agentrl.types import Completion, SamplingParams

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=24, seed=11, stop=["</answer>"])
LATENCY = {"latency": "lognormal", "latency_s": 0.005, "latency_sigma": 1.0}


def _starts(env: str) -> list[Start]:
    """Fresh groups plus two restored starts (a recorded prefix, as CRPS's and LEAFE's replays use)."""
    tasks = [t.task_id for t in make(env).tasks("train")[:3]]
    trace, _ = record(make(env), tasks[0], 5, ["Up", "Left"])
    starts = [Start(tasks[i // 2], i, f"g{i // 2}") for i in range(6)]
    starts += [Start(tasks[0], 5, "r", trace=trace, t0=1, reseed=9, max_turns=2),
               Start(tasks[0], 5, "r", trace=trace, t0=2, note="Try Down first.")]
    return starts


def _signature(episodes):
    return [(ep.task_id, ep.seed, ep.start_index, ep.won, ep.truncated, ep.dropped,
             [(t.prompt_ids, t.gen_ids, t.actions, t.fingerprints, t.reward, t.done, t.finish_reason,
               t.gen_allowed, t.info.get("plain_prompt_ids")) for t in ep.turns]) for ep in episodes]


def _roll(gen, envs, env, mode, chat_mode="window", **kw):
    cfg = RolloutConfig(max_turns=3, chat_mode=chat_mode, sampling=SAMPLING, constrain_actions=True, mode=mode, **kw)
    eng = RolloutEngine(gen, gen.tokenizer, envs, env, cfg)
    return eng.run(_starts("sokoban")), eng.stats


@pytest.mark.parametrize("chat_mode", ["window", "full"])
def test_async_rolls_out_the_episodes_lockstep_does(tiny_generator, chat_mode):
    """Seeded run, in-process slots with a random step delay (so answers arrive out of order): async gives
    lockstep's episodes token for token, fresh and restored starts alike, in start order."""
    g = tiny_generator
    env = "latency:sokoban"
    with InProcessEnvs(env, 3, LATENCY) as envs:
        lock, lock_stats = _roll(g, envs, env, "lockstep", chat_mode)
        asy, asy_stats = _roll(g, envs, env, "async", chat_mode)
    assert _signature(asy) == _signature(lock)
    for a, b in zip(asy, lock):
        for ta, tb in zip(a.turns, b.turns):
            assert all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(ta.gen_logprobs, tb.gen_logprobs))
    assert lock_stats["env_steps"] == asy_stats["env_steps"] > 8  # constrained answers: every turn steps
    assert asy_stats["generate_calls"] >= 1 and asy_stats["turns"] == lock_stats["turns"]


def test_async_with_the_process_pool_matches_lockstep(tiny_generator):
    g = tiny_generator
    env = "latency:sokoban"
    with EnvPool(env, 2, LATENCY) as envs:
        lock, _ = _roll(g, envs, env, "lockstep")
        asy, _ = _roll(g, envs, env, "async")
        assert envs.stats["crashes"] == 0
    assert _signature(asy) == _signature(lock)


def test_async_accepts_a_pool_without_submit_and_keeps_it_open(tiny_generator):
    """A third-party EnvSlots with only the batched calls still rolls out async (threads over its calls)."""
    g = tiny_generator

    class Plain:  # the synchronous protocol only
        def __init__(self):
            self.inner, self.stats, self.last_error = InProcessEnvs("sokoban", 2), {}, ""

        def __len__(self):
            return 2

        def reset(self, r):
            return self.inner.reset(r)

        def restore(self, r):
            return self.inner.restore(r)

        def step(self, a):
            return self.inner.step(a)

        def call(self, slot, method, *a, **kw):
            return self.inner.call(slot, method, *a, **kw)

        def close(self):
            self.inner.close()

    plain = Plain()
    assert not isinstance(plain, AsyncEnvSlots) and isinstance(as_async(plain), AsyncEnvSlots)
    with InProcessEnvs("sokoban", 2) as envs:
        lock, _ = _roll(g, envs, "sokoban", "lockstep")
    asy, _ = _roll(g, plain, "sokoban", "async")
    assert _signature(asy) == _signature(lock)
    assert plain.reset({0: ("train/00000", 0)})[0].obs  # still open: the view closed only its threads
    plain.close()


def test_async_through_agentrl_serve_sends_concurrent_requests_and_matches_lockstep(tiny_generator):
    """A served generator gets one request per episode turn, many in flight (the server batches them);
    with per-row seeds the episodes are lockstep's."""
    from agentrl.generation.client import RemoteGenerator
    from agentrl.generation.server import start_server

    g = tiny_generator
    srv = start_server(g, "tiny-test", port=0)
    try:
        client = RemoteGenerator(f"http://127.0.0.1:{srv.server_address[1]}")
        client.tokenizer = g.tokenizer
        with InProcessEnvs("latency:sokoban", 3, LATENCY) as envs:
            lock, _ = _roll(client, envs, "latency:sokoban", "lockstep")
            asy, stats = _roll(client, envs, "latency:sokoban", "async")
    finally:
        srv.shutdown()
    assert _signature(asy) == _signature(lock)
    assert stats["generate_calls"] == stats["turns"]  # one request per turn


def test_async_raises_a_generator_error_with_nothing_left_in_flight(tiny_generator):
    g = tiny_generator

    class Failing:
        tokenizer, stop_ids = g.tokenizer, ()

        def generate(self, prompts, sampling, seeds=None, choices=None):
            raise RuntimeError("server gone")

    with InProcessEnvs("sokoban", 2) as envs:
        with pytest.raises(RuntimeError, match="server gone"):
            _roll(Failing(), envs, "sokoban", "async")
        assert threading.active_count() < 50


def test_rollout_mode_is_checked():
    """Checked where configs are loaded (the engine's view of ``rollout`` takes a checked config)."""
    from agentrl.config import ConfigError
    from agentrl.config_loader import load_config

    with pytest.raises(ConfigError, match="rollout.mode"):
        load_config("grpo", env="sokoban", overrides=["rollout.mode=parallel"])


def test_submit_steps_slots_concurrently_and_matches_the_batched_call():
    """One slot's slow step does not hold up another's: two 0.3 s steps in flight at once take ~0.3 s."""
    kw = {"latency": "fixed", "latency_s": 0.3}
    with InProcessEnvs("latency:bandit", 2, kw) as envs:
        task = envs.call(0, "tasks", "train")[0].task_id
        futs = [envs.submit(i, "reset", task, 3) for i in range(2)]
        assert [f.result().obs for f in futs] == [r.obs for r in envs.reset({0: (task, 3), 1: (task, 3)}).values()]
        action = envs.call(0, "expert_action")
        t = time.perf_counter()
        futs = [envs.submit(i, "step", action) for i in range(2)]
        results = [f.result() for f in futs]
        assert time.perf_counter() - t < 0.55
        assert results[0].info["fingerprint"] == results[1].info["fingerprint"]
        assert envs.submit(0, "call", "prompt_spec").result().answer_tag
        with pytest.raises(ValueError, match="op must be"):
            envs.submit(0, "jump")


# ----- the latency env --------------------------------------------------------------------------------
def test_latency_env_delays_steps_reproducibly_and_changes_nothing_else():
    plain, slow = make("sokoban"), make("latency:sokoban", latency="fixed", latency_s=0.05)
    assert slow.name == "latency:sokoban"
    assert slow.reset("train/00002", 4) == plain.reset("train/00002", 4)
    t = time.perf_counter()
    a = slow.step("Up")
    assert time.perf_counter() - t >= 0.05
    assert a == plain.step("Up") and slow.steps == plain.steps == 1
    tail = make("latency:sokoban", latency="pareto", latency_s=0.01, latency_alpha=1.2, latency_seed=3)
    draws = [tail.delay("train/00001", s, k) for s in range(50) for k in range(1, 5)]
    assert draws == [tail.delay("train/00001", s, k) for s in range(50) for k in range(1, 5)]  # seeded
    assert min(draws) >= 0.01 and max(draws) > 10 * min(draws)  # long-tailed
    logn = make("latency:bandit", latency="lognormal", latency_s=0.02, latency_sigma=1.0)
    med = sorted(logn.delay("train/0", s, 1) for s in range(401))[200]
    assert 0.015 < med < 0.027  # median latency_s


def test_latency_env_options_are_checked():
    with pytest.raises(EnvError, match="latency must be one of"):
        make("latency:sokoban", latency="gaussian")
    with pytest.raises(EnvError, match="latency_s"):
        make("latency:sokoban", latency_s=-1)
    with pytest.raises(EnvError, match="unknown env"):
        make("latency:nosuchenv")


# ----- the scheduler --------------------------------------------------------------------------------------
class _Gated:
    """Records each call's prompts; the first call waits until released (requests pile up meanwhile)."""

    def __init__(self):
        self.calls, self.release = [], threading.Event()

    def generate(self, prompts, sampling, seeds=None):
        self.calls.append((list(prompts), seeds))
        if len(self.calls) == 1:
            self.release.wait(5)
        return [Completion(list(p), [-0.5] * len(p), f"row {p[0]}", "stop") for p in prompts]


def test_scheduler_batches_whatever_is_waiting():
    gen = _Gated()
    with BatchingScheduler(gen, SAMPLING) as sched:
        first = sched.submit([1], seed=10)
        while not gen.calls:
            time.sleep(0.01)
        rest = [sched.submit([k], seed=10 + k) for k in (2, 3, 4)]  # they arrive while the generator is busy
        assert sched.pending == 4
        gen.release.set()
        assert first.result(5).text == "row 1" and [f.result(5).text for f in rest] == ["row 2", "row 3", "row 4"]
    assert gen.calls == [([[1]], [10]), ([[2], [3], [4]], [12, 13, 14])]  # one call for the three waiting
    assert sched.calls == 2 and sched.pending == 0


def test_scheduler_lingers_for_rows_still_on_their_way_but_not_past_a_fraction_of_a_call():
    """In-process lane: with fewer rows waiting than live episodes, it waits (up to linger x its last
    call's time) for more, so rows whose env steps finish a moment apart share one call."""
    class Timed:
        def __init__(self):
            self.calls = []

        def generate(self, prompts, sampling, seeds=None):
            self.calls.append([p[0] for p in prompts])
            time.sleep(1.0 if len(self.calls) <= 2 else 0.0)
            return [Completion([1], [-1.0], "x", "stop") for _ in prompts]

    gen = Timed()
    with BatchingScheduler(gen, SAMPLING, linger=0.5) as sched:
        sched.live = 3
        sched.submit([1]).result(5)  # a 1 s call: the lane may now wait up to 0.5 s for company
        second = sched.submit([2])
        time.sleep(0.1)
        third = sched.submit([3])
        second.result(5), third.result(5)
        sched.live = 1  # one episode left: nothing to wait for
        t = time.perf_counter()
        sched.submit([4]).result(5)
        assert time.perf_counter() - t < 0.4
    assert gen.calls == [[1], [2, 3], [4]]


def test_scheduler_lanes_send_requests_concurrently_and_errors_reach_their_rows():
    class Slow:
        def __init__(self):
            self.live, self.peak, self.lock = 0, 0, threading.Lock()

        def generate(self, prompts, sampling, seeds=None):
            with self.lock:
                self.live += 1
                self.peak = max(self.peak, self.live)
            time.sleep(0.05)
            with self.lock:
                self.live -= 1
            if prompts[0] == [0]:
                raise RuntimeError("bad request")
            return [Completion([7], [-1.0], "x", "stop") for _ in prompts]

    gen = Slow()
    with BatchingScheduler(gen, SAMPLING, max_batch=1, lanes=8) as sched:
        futs = [sched.submit([k]) for k in range(8)]
        with pytest.raises(RuntimeError, match="bad request"):
            futs[0].result(5)
        assert all(f.result(5).ids == [7] for f in futs[1:])
    assert gen.peak >= 4


def test_a_server_gets_one_request_in_flight_per_live_episode():
    """Served generators batch concurrent requests themselves: the scheduler keeps every live episode's
    request out at once (none waits on the client side), however many slots there are."""
    from agentrl.generation.client import RemoteGenerator
    from agentrl.generation.scheduler import scheduler_for

    class Served(RemoteGenerator):
        def __init__(self):
            super().__init__("http://127.0.0.1:9", model="policy")
            self.live = self.peak = 0
            self.lock = threading.Lock()
            self.all_in = threading.Event()

        def generate(self, prompts, sampling, seeds=None, choices=None):
            with self.lock:
                self.live += 1
                self.peak = max(self.peak, self.live)
                if self.live == 96:
                    self.all_in.set()
            self.all_in.wait(5)
            with self.lock:
                self.live -= 1
            return [Completion([7], [-1.0], "x", "stop") for _ in prompts]

    gen = Served()
    with scheduler_for(gen, SAMPLING, 96) as sched:
        futs = [sched.submit([k], seed=k) for k in range(96)]
        assert all(f.result(10).ids == [7] for f in futs)
    assert gen.peak == 96


@pytest.mark.extended  # the bench end to end (minutes); its parts are tested above
def test_bench_async_quick(tmp_path, capsys):
    import json

    from agentrl.cli import main

    out = tmp_path / "b.json"
    assert main(["bench", "async", "--quick", "--json", str(out)]) == 0
    fig = json.loads(out.read_text())
    assert fig["same_episodes"] is True
    assert fig["lockstep_tok_s"] > 0 and fig["async_tok_s"] > 0
    assert math.isclose(fig["speedup"], fig["async_tok_s"] / fig["lockstep_tok_s"], rel_tol=1e-3)
    assert "vllm_alone_tok_s" in fig or fig["vllm"].startswith("skipped")
    # the overlap at staleness 1 whole-episode and with in-flight updates: no token more than 1 version behind
    assert fig["inflight1_step_s"] > 0 and 0 <= fig["inflight1_token_staleness"] <= 1
    assert 0 <= fig["overlap_token_staleness"] <= 1
    # continuous rollouts beside a lockstep step and the staleness-1 overlap
    assert fig["continuous_step_s"] > 0 and 0 <= fig["continuous_token_staleness"] <= 1
    want = fig["lockstep_step_s"] / fig["continuous_step_s"]
    assert math.isclose(fig["continuous_over_lockstep"], want, rel_tol=1e-3)


def test_bench_async_parts_runs_only_what_is_asked(tmp_path, capsys):
    import json

    from agentrl.cli import main

    out = tmp_path / "b.json"
    assert main(["bench", "async", "--quick", "--parts", "loop", "--json", str(out)]) == 0
    fig = json.loads(out.read_text())
    assert fig["same_episodes"] is True and "vllm" not in fig and "sync_step_s" not in fig
    with pytest.raises(SystemExit) as e:
        main(["bench", "async", "--parts", "loop,vlm"])
    assert e.value.code == 2 and "vlm: not among loop, vllm, overlap, continuous" in capsys.readouterr().err


def test_bench_async_latency_none_runs_the_env_as_it_is(tmp_path):
    """--latency none: no latency: wrapper, the env's own step times (a real slow env such as ScienceWorld)."""
    import json

    from agentrl.cli import main

    out = tmp_path / "b.json"
    assert main(["bench", "async", "--quick", "--parts", "loop", "--latency", "none", "--json", str(out)]) == 0
    fig = json.loads(out.read_text())
    assert fig["env"] == "sokoban" and fig["same_episodes"] is True and "latency_s" not in fig
