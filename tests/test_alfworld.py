"""ALFWorld: generated PDDL games on alfworld's engine, the six task types, splits, real-data loading."""
import json
import shutil

import pytest

from agentrl.envs import EnvError, make
from agentrl.envs.alfworld_gen import CATEGORY, TASK_TYPES, pddl_problem, sample_task
from agentrl.envs.check import check_env
from agentrl.envs.replay import run_expert


@pytest.fixture(scope="module")
def env():
    return make("alfworld")


def test_task_ids_and_categories(env):
    train = env.tasks("train")
    assert len(train) >= 3000 and len(env.tasks("valid")) == 140 and len(env.tasks("test")) == 134
    assert {t.category for t in train[:6]} == {"Pick", "Look", "Clean", "Heat", "Cool", "Pick2"}
    assert train[7].task_id == "train/look_at_obj_in_light/00001"


def test_generator_is_deterministic():
    a = sample_task(5, "pick_cool_then_place_in_recep", 3)
    b = sample_task(5, "pick_cool_then_place_in_recep", 3)
    assert a is not None and pddl_problem(*a, "x") == pddl_problem(*b, "x")
    room, goal = a
    assert room.scene == "Kitchen" and goal.task_type == "pick_cool_then_place_in_recep"
    assert any(r[1] == "Fridge" for r in room.receptacles)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_expert_solves_every_task_type(env):
    for task in env.tasks("train")[6:12]:
        trace, observations, info = run_expert(env, task.task_id)
        assert info["won"], (task.task_id, trace.actions)
        assert observations[0].startswith("You are in the middle of a room.")
        assert env.instruction() and len(trace.actions) <= env.max_steps
        kind = task.task_id.split("/")[1]
        verb = {"pick_clean_then_place_in_recep": "clean ", "pick_heat_then_place_in_recep": "heat ",
                "pick_cool_then_place_in_recep": "cool ", "look_at_obj_in_light": "use "}.get(kind)
        if verb:
            assert any(a.startswith(verb) for a in trace.actions), trace.actions


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_restore_and_tamper():
    rep = check_env("alfworld", n_expert=4, n_replay=4, seed=2)
    assert rep.ok and rep.success_rate == 1.0, rep.summary()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_invalid_action_and_step_limit(env):
    tid = env.tasks("train")[0].task_id
    obs0, info = env.reset(tid)
    obs, r, term, trunc, info = env.step("fly to the moon")
    assert obs == "Nothing happens." and r == 0.0 and not info["action_is_valid"] and not term
    assert env.expert_action() in info["admissible_actions"]  # the planner replans from here
    short = make("alfworld", max_steps=2)
    short.reset(tid)
    short.step("look")
    assert short.step("look")[3]  # truncated at 2 steps


def test_seen_and_unseen_rooms(env):
    n, off = env.n_layouts, env.unseen_offset
    idx = lambda t: int(t.task_id.split("/")[2])  # noqa: E731
    train_layouts = {idx(t) % n for t in env.tasks("train")}
    assert {idx(t) % n for t in env.tasks("valid")} <= train_layouts  # valid_seen: rooms from training
    assert off > n  # test (valid_unseen) layouts are offset beyond every training layout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_data_folder_is_used(tmp_path, env):
    """A folder laid out like ALFWorld's json_2.1.1 replaces the generated games."""
    for split, folder in (("train", "train"), ("valid", "valid_seen"), ("test", "valid_unseen")):
        task = env.tasks(split)[2]
        src = env.game_file(task).parent
        dst = tmp_path / "json_2.1.1" / folder / "pick_clean_then_place_in_recep-Cloth-None-Shelf-1" / "trial_T1"
        shutil.copytree(src, dst)
    real = make("alfworld", data_dir=str(tmp_path))
    assert [len(real.tasks(s)) for s in ("train", "valid", "test")] == [1, 1, 1]
    task = real.tasks("train")[0]
    assert task.category == "Clean" and task.task_id.startswith("train/pick_clean")
    trace, _, info = run_expert(real, task.task_id)
    assert info["won"]
    with pytest.raises(EnvError, match="json_2.1.1"):
        make("alfworld", data_dir=str(tmp_path / "nowhere"))


def test_game_file_format(env):
    game = json.loads(env.game_file(env.tasks("train")[3]).read_text())
    assert set(game) >= {"pddl_domain", "grammar", "pddl_problem", "solvable", "walkthrough"}
    assert game["solvable"] and "(:domain alfred)" in game["pddl_problem"]
    traj = json.loads((env.game_file(env.tasks("train")[3]).parent / "traj_data.json").read_text())
    assert traj["task_type"] in TASK_TYPES and CATEGORY[traj["task_type"]] == "Heat"
    assert traj["pddl_params"]["object_target"] and traj["pddl_params"]["parent_target"]


def test_a_game_file_appears_only_when_complete(tmp_path, monkeypatch):
    """Env workers build the same game at once: none may read a game file that is half written or not
    yet planned (a worker that did crashed with a JSONDecodeError and was restarted)."""
    from agentrl.envs import alfworld_engine
    from agentrl.envs.alfworld_gen import write_game

    folder, plan = tmp_path / "00000", alfworld_engine.plan_game
    seen = []

    def planning(path):
        seen.append(sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")))
        return plan(path)

    monkeypatch.setattr(alfworld_engine, "plan_game", planning)
    write_game(folder, 0, "pick_and_place_simple", 0)
    assert seen and all(names == [] for names in seen)  # nothing published while planning
    assert sorted(p.name for p in folder.iterdir()) == ["game.tw-pddl", "traj_data.json"]  # no drafts left
    game = json.loads((folder / "game.tw-pddl").read_text())
    assert game["solvable"] and game["walkthrough"]


# ----- the searching expert -------------------------------------------------------------------------

ROOM = ("You are in the middle of a room. Looking quickly around you, you see a cabinet 2, a cabinet 1, "
        "a countertop 1, a fridge 1, a sinkbasin 1, a toilet 1, and a microwave 1.")


def test_search_expert_looks_only_where_the_object_can_be():
    from agentrl.envs.alfworld_search import SearchGoal, receptacles, search_action

    goal = SearchGoal("pick_clean_then_place_in_recep", "mug", "countertop")
    assert receptacles(ROOM) == ["cabinet 1", "cabinet 2", "countertop 1", "fridge 1", "microwave 1",
                                 "sinkbasin 1", "toilet 1"]
    go = ["go to cabinet 1", "go to cabinet 2", "go to countertop 1", "go to toilet 1"]
    assert search_action(goal, ROOM, [], go) == "go to cabinet 1"  # by name, then number; never the toilet
    steps = [("go to cabinet 1", "You arrive at cabinet 1. The cabinet 1 is closed.")]
    assert search_action(goal, ROOM, steps, go + ["open cabinet 1"]) == "open cabinet 1"
    steps.append(("open cabinet 1", "You open the cabinet 1. The cabinet 1 is open. In it, you see a plate 1."))
    assert search_action(goal, ROOM, steps, go) == "go to cabinet 2"  # the next one after the last visited
    steps.append(("go to cabinet 2", "You arrive at cabinet 2. The cabinet 2 is open. In it, you see a mug 3."))
    assert search_action(goal, ROOM, steps, go + ["take mug 3 from cabinet 2"]) == "take mug 3 from cabinet 2"
    steps.append(("take mug 3 from cabinet 2", "You pick up the mug 3 from the cabinet 2."))
    assert search_action(goal, ROOM, steps, go) == "go to sinkbasin 1"
    steps.append(("go to sinkbasin 1", "You arrive at sinkbasin 1. On the sinkbasin 1, you see nothing."))
    assert search_action(goal, ROOM, steps, go) == "clean mug 3 with sinkbasin 1"
    steps.append(("clean mug 3 with sinkbasin 1", "You clean the mug 3 using the sinkbasin 1."))
    assert search_action(goal, ROOM, steps, go) == "go to countertop 1"
    steps.append(("go to countertop 1", "You arrive at countertop 1. On the countertop 1, you see a apple 1."))
    assert search_action(goal, ROOM, steps, go) == "move mug 3 to countertop 1"


def test_search_expert_pick_two_returns_to_an_object_it_saw():
    from agentrl.envs.alfworld_search import SearchGoal, search_action

    goal = SearchGoal("pick_two_obj_and_place", "mug", "countertop")
    steps = [("go to cabinet 1",
              "You arrive at cabinet 1. The cabinet 1 is open. In it, you see a mug 1, and a mug 2."),
             ("take mug 1 from cabinet 1", "You pick up the mug 1 from the cabinet 1."),
             ("go to countertop 1", "You arrive at countertop 1. On the countertop 1, you see nothing."),
             ("move mug 1 to countertop 1", "You move the mug 1 to the countertop 1.")]
    assert search_action(goal, ROOM, steps, ["take mug 1 from countertop 1"]) == "go to cabinet 1"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_search_expert_wins_without_the_planner():
    """The default expert solves every task type from what the agent sees; the planner is never asked."""
    env = make("alfworld")
    asked = []
    env._planner_action = lambda: asked.append(1)  # type: ignore[method-assign]
    for task in env.tasks("train")[12:18]:
        trace, _, info = run_expert(env, task.task_id)
        assert info["won"], (task.task_id, trace.actions)
    assert not asked
    with pytest.raises(EnvError, match="expert must be"):
        make("alfworld", expert="oracle")
