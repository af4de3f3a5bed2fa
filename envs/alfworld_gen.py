"""Procedural ALFWorld games: PDDL problems for the six task types, in the real game-file format.

ALFWorld's game files (``game.tw-pddl`` + ``traj_data.json``) come from ALFRED scenes that cannot be
downloaded here. This module writes equivalent files from scratch: a room of a scene type (kitchen,
living room, bedroom, bathroom) with receptacles, objects placed only where ALFRED allows them
(``alfworld.gen.constants.VAL_RECEPTACLE_OBJECTS``), object affordances (heatable, coolable, cleanable,
toggleable), and a goal from ALFWorld's own goal library. The domain (``alfred.pddl``) and grammar
(``alfred.twl2``) are the ones shipped with the ``alfworld`` package, and a problem is kept only if the
Fast Downward planner behind ALFWorld's expert solves it. Everything is a function of the seed.

Rooms ("layouts") are numbered; train tasks and ``valid`` (seen) tasks use layouts 0..n_layouts-1,
``test`` (unseen) tasks use a disjoint range of layouts, as ALFWorld's valid_seen / valid_unseen do.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.io_atomic import atomic_write_text

TASK_TYPES = ["pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
              "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place"]
# Short names used in the papers' per-category tables.
CATEGORY = {"pick_and_place_simple": "Pick", "look_at_obj_in_light": "Look", "pick_clean_then_place_in_recep": "Clean",
            "pick_heat_then_place_in_recep": "Heat", "pick_cool_then_place_in_recep": "Cool",
            "pick_two_obj_and_place": "Pick2"}
SCENES_FOR = {"pick_and_place_simple": ["Kitchen", "LivingRoom", "Bedroom", "Bathroom"],
              "pick_two_obj_and_place": ["Kitchen", "LivingRoom", "Bedroom", "Bathroom"],
              "look_at_obj_in_light": ["LivingRoom", "Bedroom"],
              "pick_clean_then_place_in_recep": ["Kitchen", "Bathroom"],
              "pick_heat_then_place_in_recep": ["Kitchen"],
              "pick_cool_then_place_in_recep": ["Kitchen"]}

# receptacle type -> (min, max) count, per scene type (ALFRED-like rooms)
ROOMS: dict[str, dict[str, tuple[int, int]]] = {
    "Kitchen": {"Cabinet": (3, 10), "Drawer": (1, 6), "CounterTop": (1, 3), "Fridge": (1, 1), "Microwave": (1, 1),
                "SinkBasin": (1, 1), "StoveBurner": (2, 4), "CoffeeMachine": (1, 1), "Toaster": (0, 1),
                "GarbageCan": (1, 1), "DiningTable": (0, 1), "Shelf": (0, 3)},
    "LivingRoom": {"Sofa": (1, 1), "ArmChair": (0, 2), "CoffeeTable": (1, 1), "SideTable": (1, 2), "TVStand": (0, 1),
                   "Shelf": (0, 4), "Drawer": (0, 4), "Cabinet": (0, 3), "GarbageCan": (1, 1), "Dresser": (0, 1),
                   "DiningTable": (0, 1), "Ottoman": (0, 1)},
    "Bedroom": {"Bed": (1, 1), "Desk": (0, 1), "Dresser": (0, 1), "Drawer": (1, 6), "Shelf": (0, 4),
                "SideTable": (1, 2), "GarbageCan": (1, 1), "LaundryHamper": (0, 1), "Safe": (0, 1), "ArmChair": (0, 1)},
    "Bathroom": {"Cabinet": (1, 4), "CounterTop": (1, 1), "SinkBasin": (1, 2), "Toilet": (1, 1),
                 "ToiletPaperHanger": (1, 1), "TowelHolder": (1, 1), "HandTowelHolder": (0, 1), "GarbageCan": (1, 1),
                 "BathtubBasin": (0, 1), "Shelf": (0, 2), "Drawer": (0, 4)},
}
OBJECTS: dict[str, list[str]] = {
    "Kitchen": ["Apple", "Bread", "Egg", "Lettuce", "Potato", "Tomato", "Mug", "Cup", "Bowl", "Plate", "Pan", "Pot",
                "Fork", "Spoon", "Knife", "ButterKnife", "Spatula", "Ladle", "DishSponge", "Kettle", "SaltShaker",
                "PepperShaker", "SoapBottle", "WineBottle", "Glassbottle", "PaperTowel"],
    "LivingRoom": ["Book", "Box", "CreditCard", "KeyChain", "Laptop", "Newspaper", "Pillow", "RemoteControl", "Statue",
                   "Vase", "Watch", "WateringCan", "TissueBox", "Plate", "Bowl", "CellPhone", "Candle"],
    "Bedroom": ["Book", "CD", "CellPhone", "CreditCard", "KeyChain", "Laptop", "Pen", "Pencil", "Pillow", "AlarmClock",
                "Bowl", "Mug", "BaseballBat", "BasketBall", "TennisRacket", "Box", "Cloth", "Watch"],
    "Bathroom": ["SoapBar", "SoapBottle", "Cloth", "ToiletPaper", "HandTowel", "Towel", "SprayBottle", "Candle",
                 "DishSponge", "Plunger", "TissueBox", "PaperTowel"],
}
OPENABLE = {"Fridge", "Cabinet", "Microwave", "Drawer", "Safe", "Box"}
LAMP_HOLDERS = {"Desk", "SideTable", "Dresser"}
# Look tasks in ALFRED examine small objects that can be picked up.
LOOK_OBJECTS = {"Book", "CD", "CellPhone", "CreditCard", "KeyChain", "Laptop", "Pen", "Pencil", "Pillow", "AlarmClock",
                "Bowl", "Mug", "Box", "Statue", "Vase", "Watch", "RemoteControl", "Newspaper", "Cloth", "TissueBox",
                "BaseballBat", "BasketBall", "TennisRacket", "Candle"}


def _constants() -> Any:
    import alfworld.gen.constants as constants

    return constants


def _coord(rng: random.Random) -> str:
    def one() -> str:
        v = rng.uniform(-3, 3)
        sign = "_minus_" if v < 0 else "_plus_"
        whole, frac = f"{abs(v):05.2f}".split(".")
        return f"{sign}{whole}_dot_{frac}"

    return "_bar_".join(one() for _ in range(3))


def _loc(rng: random.Random) -> str:
    parts = [rng.randint(-9, 9), rng.randint(-9, 9), rng.randint(0, 3), rng.choice([-30, 0, 30, 45, 60])]
    return "loc" + "".join(f"_bar__minus_{-p}" if p < 0 else f"_bar_{p}" for p in parts)


def _receptacle_id(rtype: str, rng: random.Random) -> str:
    # ALFRED names basins after their fixture ("Sink|...|SinkBasin"); the demangler relies on that.
    if rtype.endswith("Basin"):
        return f"{rtype[:-len('Basin')]}_bar_{_coord(rng)}_bar_{rtype}"
    return f"{rtype}_bar_{_coord(rng)}"


@dataclass
class Room:
    scene: str
    receptacles: list[tuple[str, str, str]]  # (id, type, location)
    objects: list[tuple[str, str, str]]  # (id, type, receptacle id)
    agent_loc: str


def make_room(layout: int, scene: str) -> Room:
    """The static part of a layout: receptacles and where they are. Deterministic in (layout, scene)."""
    rng = random.Random(f"alfworld-room-{scene}-{layout}")
    receptacles = []
    used_locs: set[str] = set()
    for rtype, (lo, hi) in ROOMS[scene].items():
        for _ in range(rng.randint(lo, hi)):
            loc = _loc(rng)
            while loc in used_locs:
                loc = _loc(rng)
            used_locs.add(loc)
            receptacles.append((_receptacle_id(rtype, rng), rtype, loc))
    agent_loc = _loc(rng)
    while agent_loc in used_locs:
        agent_loc = _loc(rng)
    return Room(scene, receptacles, [], agent_loc)


def _holders(room: Room, otype: str) -> list[tuple[str, str, str]]:
    val = _constants().VAL_RECEPTACLE_OBJECTS
    if otype == "DeskLamp":
        return [r for r in room.receptacles if r[1] in LAMP_HOLDERS]
    return [r for r in room.receptacles if otype in val.get(r[1], ())]


def _place(rng: random.Random, room: Room, otype: str, exclude_types: set[str] = frozenset()) -> bool:
    holders = [r for r in _holders(room, otype) if r[1] not in exclude_types]
    if not holders:
        return False
    r = rng.choice(holders)
    room.objects.append((f"{otype}_bar_{_coord(rng)}", otype, r[0]))
    return True


@dataclass
class Goal:
    task_type: str
    obj: str
    recep: str = ""
    toggle: str = ""


def sample_task(layout: int, task_type: str, seed: int) -> tuple[Room, Goal] | None:
    """Fill a layout with objects and pick a goal of ``task_type``; None if this draw does not fit."""
    rng = random.Random(f"alfworld-task-{layout}-{task_type}-{seed}")
    scene = rng.choice(SCENES_FOR[task_type])
    room = make_room(layout, scene)
    c = _constants()
    rtypes = {r[1] for r in room.receptacles}
    pool = [o for o in OBJECTS[scene] if _holders(room, o)]
    if task_type == "look_at_obj_in_light":
        if not rtypes & LAMP_HOLDERS:
            return None
        pool = [o for o in pool if o in LOOK_OBJECTS]
        if not pool:
            return None
        goal = Goal(task_type, rng.choice(pool), toggle="DeskLamp")
        _place(rng, room, "DeskLamp")
        _place(rng, room, goal.obj)
    else:
        need = {"pick_clean_then_place_in_recep": ("Cleanable", "SinkBasin"),
                "pick_heat_then_place_in_recep": ("Heatable", "Microwave"),
                "pick_cool_then_place_in_recep": ("Coolable", "Fridge")}.get(task_type)
        if need:
            if need[1] not in rtypes:
                return None
            pool = [o for o in pool if o in c.VAL_ACTION_OBJECTS[need[0]]]
        if not pool:
            return None
        obj = rng.choice(pool)
        # The target receptacle type must hold the object and not be the appliance that changes its state.
        targets = sorted({r[1] for r in _holders(room, obj)} - {"Microwave", "Fridge", "SinkBasin"} if need
                         else {r[1] for r in _holders(room, obj)})
        if not targets:
            return None
        goal = Goal(task_type, obj, recep=rng.choice(targets))
        n = 2 if task_type == "pick_two_obj_and_place" else 1
        for _ in range(n + rng.randint(0, 1)):
            # Start the objects outside the target so the task is not already done.
            _place(rng, room, obj, exclude_types={goal.recep})
        if sum(o[1] == obj for o in room.objects) < n:
            return None
    # Distractors: other objects wherever they may go.
    for _ in range(rng.randint(4, 12)):
        other = rng.choice(pool + OBJECTS[scene])
        if other != goal.obj:
            _place(rng, room, other)
    return room, goal


def pddl_problem(room: Room, goal: Goal, name: str) -> str:
    c = _constants()
    otypes = sorted({o[1] for o in room.objects})
    rtypes = sorted({r[1] for r in room.receptacles})
    locs = sorted({r[2] for r in room.receptacles} | {room.agent_loc})
    objs = ["agent1 - agent"]
    objs += [f"{t}Type - otype" for t in otypes] + [f"{t}Type - rtype" for t in rtypes]
    objs += [f"{o[0]} - object" for o in room.objects] + [f"{r[0]} - receptacle" for r in room.receptacles]
    objs += [f"{loc} - location" for loc in locs]
    init = [f"(atLocation agent1 {room.agent_loc})"]
    for rid, rtype, loc in room.receptacles:
        init.append(f"(receptacleType {rid} {rtype}Type)")
        init.append(f"(receptacleAtLocation {rid} {loc})")
        if rtype in OPENABLE:
            init.append(f"(openable {rid})")
    val = c.VAL_RECEPTACLE_OBJECTS
    for rt in rtypes:
        for ot in otypes:
            if ot in val.get(rt, ()) or (ot == "DeskLamp" and rt in LAMP_HOLDERS):
                init.append(f"(canContain {rt}Type {ot}Type)")
    loc_of = {r[0]: r[2] for r in room.receptacles}
    affordance = {"Heatable": "heatable", "Coolable": "coolable", "Cleanable": "cleanable", "Toggleable": "toggleable"}
    for oid, otype, rid in room.objects:
        init.append(f"(objectType {oid} {otype}Type)")
        init.append(f"(inReceptacle {oid} {rid})")
        init.append(f"(objectAtLocation {oid} {loc_of[rid]})")
        if otype != "DeskLamp":
            init.append(f"(pickupable {oid})")
        if otype in c.MOVABLE_RECEPTACLES_SET:
            init.append(f"(isReceptacleObject {oid})")
        for key, pred in affordance.items():
            if otype in c.VAL_ACTION_OBJECTS[key]:
                init.append(f"({pred} {oid})")
    gdict = _goal_library()
    goal_pddl = gdict[goal.task_type]["pddl"].replace("#", "-").format(obj=goal.obj, recep=goal.recep,
                                                                       toggle=goal.toggle)
    nl = "\n        "
    # The goal-library text closes the (define ...) form itself.
    return (f"(define (problem {name})\n    (:domain alfred)\n    (:objects\n        {nl.join(objs)}\n    )\n"
            f"    (:init\n        {nl.join(init)}\n    )\n{goal_pddl}")


def _goal_library() -> dict:
    import alfworld.gen.goal_library as glib

    return glib.gdict


def task_description(goal: Goal, rng: random.Random) -> str:
    template = rng.choice(_goal_library()[goal.task_type]["templates"])
    return template.format(obj=goal.obj.lower(), recep=goal.recep.lower(), toggle=goal.toggle.lower(), mrecep="")


def traj_data(goal: Goal, scene: str, layout: int) -> dict[str, Any]:
    return {"task_type": goal.task_type,
            "pddl_params": {"object_target": goal.obj, "parent_target": goal.recep, "toggle_target": goal.toggle,
                            "mrecep_target": "", "object_sliced": False},
            "scene": {"scene_type": scene, "layout": layout, "generated_by": "agentrl"}}


def alfworld_data_files() -> tuple[str, str]:
    import alfworld

    root = Path(alfworld.__file__).parent / "data"
    return (root / "alfred.pddl").read_text(), (root / "alfred.twl2").read_text()


def write_game(folder: Path, layout: int, task_type: str, seed: int, max_tries: int = 50) -> dict[str, Any]:
    """Write ``game.tw-pddl`` and ``traj_data.json`` for the first draw the planner solves. The game file
    appears only once it is planned, so its existence means it is complete and solvable."""
    from agentrl.envs.alfworld_engine import plan_game

    domain, grammar = alfworld_data_files()
    folder.mkdir(parents=True, exist_ok=True)
    draft = folder / f".draft-{os.getpid()}.tw-pddl"  # one per process: the planner reads it from disk
    try:
        for attempt in range(max_tries):
            drawn = sample_task(layout, task_type, seed * 1000 + attempt)
            if drawn is None:
                continue
            room, goal = drawn
            traj = traj_data(goal, room.scene, layout)
            desc = task_description(goal, random.Random(f"desc-{layout}-{task_type}-{seed}"))
            game = {"pddl_domain": domain, "grammar": grammar.replace("UNKNOWN GOAL", desc),
                    "pddl_problem": pddl_problem(room, goal, f"agentrl_{task_type}_{layout}_{seed}"),
                    "solvable": None, "walkthrough": None}
            draft.write_text(json.dumps(game))
            plan = plan_game(draft)
            if plan:
                game["solvable"], game["walkthrough"] = True, plan
                atomic_write_text(folder / "traj_data.json", json.dumps(traj))
                atomic_write_text(folder / "game.tw-pddl", json.dumps(game))
                return traj
    finally:
        draft.unlink(missing_ok=True)
    raise RuntimeError(f"alfworld generator: no solvable {task_type} task for layout {layout}, seed {seed}")
