"""The env contract: registry, task ids, errors, info keys, and the divergence error."""
import pytest

from agentrl.envs import DivergenceError, EnvError, Trace, make, names, replay
from agentrl.envs.registry import fast_names
from agentrl.envs.replay import record, run_expert

FAST = fast_names()


def test_registry_lists_all_issue_envs():
    assert {"sokoban", "sokoban-large", "sokoban-newvocab", "frozenlake", "bandit", "bandit-reversed",
            "textworld", "scienceworld"} <= set(names())


def test_unknown_env_names_the_registered_ones():
    with pytest.raises(EnvError, match="unknown env 'sokobon'.*sokoban"):
        make("sokobon")


def test_unknown_option_is_named():
    with pytest.raises(EnvError, match="unknown option.*colour"):
        make("sokoban", colour="red")


@pytest.mark.parametrize("bad", ["train/99999999", "nonsense", "holdout/00001"])
def test_bad_task_id(bad):
    with pytest.raises(EnvError):
        make("sokoban").reset(bad)


def test_step_before_reset_and_after_end():
    env = make("bandit")
    with pytest.raises(EnvError, match="before reset"):
        env.step("x")
    tid = env.tasks("train")[0].task_id
    env.reset(tid)
    env.step(env.expert_action())
    with pytest.raises(EnvError, match="after the episode ended"):
        env.step("x")


@pytest.mark.parametrize("name", FAST)
def test_splits_disjoint_and_ids_stable(name):
    a, b = make(name), make(name)
    ids = {s: [t.task_id for t in a.tasks(s)] for s in ("train", "valid", "test")}
    assert ids == {s: [t.task_id for t in b.tasks(s)] for s in ids}
    assert not set(ids["train"]) & set(ids["test"]) and not set(ids["valid"]) & set(ids["test"])
    # the same id is the same task on a fresh instance
    o1, _ = a.reset(ids["test"][3], seed=5)
    o2, _ = b.reset(ids["test"][3], seed=5)
    assert o1 == o2


@pytest.mark.parametrize("name", FAST)
def test_info_keys(name):
    env = make(name)
    obs, info = env.reset(env.tasks("train")[1].task_id, seed=1)
    for key in ("won", "score", "admissible_actions", "fingerprint", "action_is_valid", "step", "task_id"):
        assert key in info
    obs, r, term, trunc, info = env.step(env.expert_action())
    assert isinstance(obs, str) and isinstance(r, float)
    assert info["step"] == 1


def test_truncation_at_max_steps():
    env = make("sokoban", max_steps=3)
    env.reset("train/00000")
    results = [env.step("xyzzy") for _ in range(3)]
    assert [r[3] for r in results] == [False, False, True]  # truncated only at the limit
    assert not any(r[2] for r in results)
    assert env.done


def test_divergence_error_names_env_task_step():
    env = make("sokoban")
    trace, _, _ = run_expert(env, "train/00007")
    assert len(trace.actions) >= 2
    bad = Trace(trace.env, trace.task_id, trace.seed, list(trace.actions), list(trace.fingerprints))
    bad.actions[1] = "xyzzy"
    with pytest.raises(DivergenceError) as e:
        replay(env, bad)
    msg = str(e.value)
    assert "sokoban" in msg and "train/00007" in msg and "step 2" in msg
    assert e.value.step == 2


def test_replay_cut_points_and_reseed():
    env = make("frozenlake")
    trace, observations = record(env, "train/00011", 3, ["Down", "Right", "Right", "Down", "Left", "Up"])
    for t in range(len(trace.actions) + 1):
        obs, info = replay(make("frozenlake"), trace, t)
        assert obs == observations[t] and info["fingerprint"] == trace.fingerprints[t]
    with pytest.raises(EnvError, match="cut point"):
        replay(env, trace, len(trace.actions) + 1)


def test_trace_roundtrip():
    env = make("bandit")
    trace, _, _ = run_expert(env, env.tasks("valid")[0].task_id, seed=9)
    assert Trace.from_dict(trace.to_dict()) == trace
    with pytest.raises(ValueError):
        Trace("bandit", "x", 0, ["a"], ["f"])  # needs len(actions)+1 fingerprints


@pytest.mark.parametrize("name", ["webshop", "sokoban", "frozenlake", "bandit"])
def test_misuse_is_one_typed_line(name):
    """step(None), step(123), reset(None) were AttributeErrors, restore({}) a KeyError, seed=-1 Gymnasium's own error
    (frozenlake) or silently taken, replaying a fingerprint-less trace past the episode's end an IndexError. Each is
    one EnvError line naming the env, checked in the base class for every env."""
    env = make(name)
    tid = env.tasks("train")[0].task_id

    def refused(words, call, *args):
        with pytest.raises(EnvError, match=words) as e:
            call(*args)
        assert f"env '{name}'" in str(e.value) or isinstance(e.value, DivergenceError)
        assert "\n" not in str(e.value)

    for bad in (None, 123):
        refused("a task id is a string such as 'train/00042', got ", env.reset, bad)
    for bad in (-1, 1.5, "3"):
        refused("bad seed .*; allowed: an integer >= 0", env.reset, tid, bad)
    env.reset(tid, 0)
    for bad in (None, 123, b"Up"):
        refused("an action is text, got ", env.step, bad)
    snap = env.snapshot()
    for bad in ({}, None, {"base": {}}):
        refused(r"restore\(\) takes what this env's snapshot\(\) returned", env.restore, bad)
    env.restore(snap)  # the refusals changed nothing: the env goes on from where it was
    assert env.steps == 0 and not env.done
    env.step(env.expert_action() or "x")
    actions = [env.expert_action() or "x"] * (env.max_steps + 2)
    refused("the episode ended after", replay, env, Trace(env.name, tid, 0, actions, []))


@pytest.mark.parametrize("name", ["webshop", "sokoban", "frozenlake", "textworld"])
def test_task_ids_are_parsed_strictly(name):
    """int() made WebShop's train/-1 its last task and, in all four envs, train/+1, train/ 1, train/0_1, train/1 and an
    Arabic-Indic digit other names of train/00001: a task id is ASCII digits in the canonical form, in range."""
    env = make(name)
    n = len(env.tasks("train"))
    for bad in ["train/-1", f"train/-{n}", "train/+1", "train/ 1", "train/0_1", "train/\u0661", "train/1",
                "train/000001", "train/00001 ", "train/00001\n"]:
        with pytest.raises(EnvError, match=f"env '{name}': malformed task id") as e:
            env.get_task(bad)
        assert "\n" not in str(e.value)
    for bad in [f"train/{n:05d}", "dev/00001"]:
        with pytest.raises(EnvError, match=f"env '{name}': unknown task id .*; allowed: .*train/{n - 1:05d}"):
            env.get_task(bad)
    assert env.get_task("train/00001").task_id == "train/00001"
