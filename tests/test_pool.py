"""The env worker pool: batched steps, and crashed or hung workers that neither lose nor corrupt episodes."""
import os
import signal

import pytest

from agentrl.envs import EnvError, make
from agentrl.envs.pool import EnvPool
from agentrl.envs.replay import run_expert

CRASHY = "tests.crash_envs:CrashOnCommandEnv"


def _play_with_pool(pool, slot_tasks, seeds, sabotage):
    """Run the expert in every slot; ``sabotage(step_index, pool)`` may kill or freeze workers."""
    res = pool.reset({i: (t, seeds[i]) for i, t in enumerate(slot_tasks)})
    obs = {i: [r.obs] for i, r in res.items()}
    live = set(res)
    k = 0
    while live:
        actions = {i: pool.call(i, "expert_action") for i in sorted(live)}
        sabotage(k, pool, sorted(live))
        for i, r in pool.step(actions).items():
            assert not r.dropped, r.info
            obs[i].append(r.obs)
            if r.done:
                live.discard(i)
        k += 1
    return obs


def _reference(name, tasks, seeds):
    env = make(name)
    return {i: run_expert(env, t, seeds[i])[1] for i, t in enumerate(tasks)}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killed_worker_mid_episode_is_restored_exactly():
    tasks, seeds = ["train/00011", "train/00014", "train/00016"], [0, 0, 0]  # expert needs 7, 6, 11 steps

    def kill(k, pool, live):
        if k in (1, 2):  # every expert episode here is longer than 3 steps
            os.kill(pool.pid(live[k % len(live)]), signal.SIGKILL)

    with EnvPool("sokoban-large", 3, step_timeout=20) as pool:
        got = _play_with_pool(pool, tasks, seeds, kill)
        assert pool.stats["restarts"] == 2 and pool.stats["replayed"] == 2 and pool.stats["dropped"] == 0
    assert got == _reference("sokoban-large", tasks, seeds)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stochastic_env_survives_kill_and_hang():
    """FrozenLake's slips come from its RNG; the replay must reproduce them, or the episode is corrupt."""
    tasks, seeds = ["train/00003", "train/00004"], [7, 8]

    def sabotage(k, pool, live):
        if k == 1:
            os.kill(pool.pid(live[0]), signal.SIGKILL)
        if k == 2:
            os.kill(pool.pid(live[-1]), signal.SIGSTOP)  # hung, not dead: only the timeout can tell

    with EnvPool("frozenlake", 2, step_timeout=3) as pool:
        got = _play_with_pool(pool, tasks, seeds, sabotage)
        assert pool.stats["timeouts"] == 1 and pool.stats["restarts"] == 2 and pool.stats["dropped"] == 0
    assert got == _reference("frozenlake", tasks, seeds)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_deterministic_crash_is_dropped_and_counted():
    with EnvPool(CRASHY, 2, step_timeout=3, max_restarts=2) as pool:
        pool.reset({0: ("train/00001", 0), 1: ("train/00002", 0)})
        out = pool.step({0: "crash", 1: "Up"})
        assert out[0].dropped and out[0].done and "drop_reason" in out[0].info
        assert not out[1].dropped
        assert pool.stats["dropped"] == 1 and pool.stats["restarts"] == 2
        with pytest.raises(EnvError, match="without a live episode"):
            pool.step({0: "Up"})
        out = pool.step({1: "hang"})
        assert out[1].dropped and pool.stats["dropped"] == 2 and pool.stats["timeouts"] >= 1
        # a dropped slot is usable again after a reset
        r = pool.reset({0: ("train/00001", 0)})
        assert not r[0].dropped and not pool.step({0: "Up"})[0].dropped
        # an exception the env raises in its worker is a crash too, and the pool keeps why
        crashes = pool.stats["crashes"]
        assert pool.step({0: "raise"})[0].dropped and pool.stats["crashes"] == crashes + 3  # try + 2 restarts
        assert pool.last_error == "ValueError: the env's own bug"


@pytest.mark.timeout(60)
def test_caller_errors_are_raised_not_retried():
    with EnvPool("sokoban", 2) as pool:
        with pytest.raises(EnvError, match="unknown task id"):
            pool.reset({0: ("train/00001", 0), 1: ("train/99999999", 0)})
        assert pool.stats["restarts"] == 0
        # the healthy slot's reset was still booked
        assert not pool.step({0: "Up"})[0].dropped


@pytest.mark.timeout(60)
def test_restore_by_replay_in_workers():
    env = make("sokoban")
    trace, observations, _ = run_expert(env, "train/00021")  # 7 steps
    with EnvPool("sokoban", 2) as pool:
        out = pool.restore({0: (trace, 2, None), 1: (trace, 0, None)})
        assert out[0].obs == observations[2] and out[1].obs == observations[0]
        # the restored slot continues like the original trajectory
        assert pool.step({0: trace.actions[2]})[0].obs == observations[3]
        bad = trace.prefix(len(trace.actions))
        bad.fingerprints[1] = "0" * 16
        with pytest.raises(EnvError, match="diverged"):
            pool.restore({0: (bad, 2, None)})
