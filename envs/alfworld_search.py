"""ALFWorld's searching expert: finds things by looking where they can be, from what the agent sees.

The planner expert reads the PDDL state and walks straight to a hidden object; a policy imitating it
learns to guess where things are. This expert uses only what the policy is shown (the goal, the
observations, the admissible commands) plus the common sense of ALFRED's receptacle/object table
(``VAL_RECEPTACLE_OBJECTS``: a mug can be in a cabinet, not in a toilet). It visits the receptacles that
can hold what it looks for in one fixed order (by name, then number), opens closed ones, takes the
object when a ``take`` command for it appears, cleans/heats/cools it at the first sink basin,
microwave or fridge, and puts it in the first receptacle of the target type. Its choice depends on the
last visited receptacle, which the policy's two-step history window shows.

A pure function of the episode so far, so it needs no state of its own and replays exactly.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from agentrl.envs.alfworld_gen import LAMP_HOLDERS as _LAMP_TYPES

TRANSFORM = {"pick_clean_then_place_in_recep": ("clean", "sinkbasin"),
             "pick_heat_then_place_in_recep": ("heat", "microwave"),
             "pick_cool_then_place_in_recep": ("cool", "fridge")}
LAMP_HOLDERS = {t.lower() for t in _LAMP_TYPES}  # where the generator puts desk lamps
_SEEN = re.compile(r"\ban? ([a-z]+ \d+)")


@dataclass(frozen=True)
class SearchGoal:
    task_type: str
    obj: str  # lowercase object type, e.g. "soapbottle"
    recep: str = ""  # lowercase receptacle type to place in
    toggle: str = ""  # "desklamp" for look tasks

    @classmethod
    def from_pddl_params(cls, task_type: str, params: dict) -> "SearchGoal":
        return cls(task_type, str(params.get("object_target", "")).lower(),
                   str(params.get("parent_target", "")).lower(), str(params.get("toggle_target", "")).lower())


@lru_cache(maxsize=1)
def _holders() -> dict[str, set[str]]:
    import alfworld.gen.constants as constants

    return {r.lower(): {o.lower() for o in objs} for r, objs in constants.VAL_RECEPTACLE_OBJECTS.items()}


def _rtype(name: str) -> str:
    return name.rsplit(" ", 1)[0]


def _order(name: str) -> tuple[str, int]:
    kind, _, num = name.rpartition(" ")
    return kind, int(num) if num.isdigit() else 0


def receptacles(first_obs: str) -> list[str]:
    """The room's receptacles from the opening "Looking quickly around you, you see ..." line."""
    return sorted(set(_SEEN.findall(first_obs.partition("you see")[2])), key=_order)


def _candidates(rooms: list[str], thing: str) -> list[str]:
    if thing == "desklamp":
        found = [r for r in rooms if _rtype(r) in LAMP_HOLDERS]
    else:
        found = [r for r in rooms if thing in _holders().get(_rtype(r), ())]
    return found or rooms  # unknown types (real data): look everywhere


def search_action(goal: SearchGoal, first_obs: str, steps: list[tuple[str, str]], admissible: list[str]) -> str | None:
    """The next action, or None when the expert has nothing left to try (the caller falls back)."""
    rooms = receptacles(first_obs)
    at, holding = "", ""
    opened: set[str] = set()
    closed_seen: set[str] = set()
    visited: list[str] = []  # receptacles whose contents were seen, in visiting order
    contents: dict[str, set[str]] = {}
    taken: set[str] = set()
    done_with: set[str] = set()  # instances transformed (cleaned, heated, cooled)
    placed: list[tuple[str, str]] = []
    for action, feedback in steps:
        if action.startswith("go to ") and feedback.startswith("You arrive"):
            at = action[6:]
            if f"{at} is closed" in feedback:
                closed_seen.add(at)
        elif action.startswith("open ") and feedback.startswith("You open"):
            opened.add(action[5:])
        elif action.startswith("take ") and feedback.startswith("You pick up"):
            holding = action[5:].partition(" from ")[0]
            taken.add(holding)
        elif action.startswith("move ") and feedback.startswith("You move"):
            inst, _, dest = action[5:].partition(" to ")
            placed.append((inst, dest))
            holding = ""
        elif feedback.startswith(("You clean the", "You heat the", "You cool the")):
            done_with.add(" ".join(action.split(" ")[1:3]))  # "clean mug 3 with ..." -> "mug 3"
        if at and ("you see" in feedback) and (feedback.startswith(("You arrive", "You open"))):
            if at not in visited:
                visited.append(at)
            contents[at] = set(_SEEN.findall(feedback.partition("you see")[2]))

    def go(place: str) -> str:
        return f"go to {place}"

    def first_of(kind: str) -> str | None:
        return next((r for r in rooms if _rtype(r) == kind), None)

    def find(thing: str, use: bool = False) -> str | None:
        skip = {dest for _, dest in placed}
        if at and at not in skip:
            if use:
                lamp = next((a for a in admissible if a.startswith(f"use {thing} ")), None)
                if lamp:
                    return lamp
            else:
                take = sorted((a for a in admissible if a.startswith(f"take {thing} ") and a.endswith(f" from {at}")
                               and a[5:].partition(" from ")[0] not in taken),
                              key=lambda a: _order(a[5:].split(" from ")[0]))
                if take:
                    return take[0]
            if at in closed_seen and at not in opened:
                return f"open {at}"
        # something seen earlier and not taken (the second object of a pick-two task)
        for place in visited:
            if place != at and place not in skip and any(
                    _rtype(x) == thing and x not in taken for x in contents.get(place, ())):
                return go(place)
        for place in _candidates(rooms, thing):
            if place not in visited and place not in skip and place != at:
                return go(place)
        return None

    if goal.task_type == "look_at_obj_in_light":
        if not holding:
            return find(goal.obj)
        return find(goal.toggle or "desklamp", use=True)
    if holding:
        transform = TRANSFORM.get(goal.task_type)
        if transform and holding not in done_with:
            verb, kind = transform
            place = first_of(kind)
            if place is None:
                return None
            return go(place) if at != place else f"{verb} {holding} with {place}"
        target = first_of(goal.recep)
        if target is None:
            return None
        if at != target:
            return go(target)
        if target in closed_seen and target not in opened:
            return f"open {target}"
        return f"move {holding} to {target}"
    return find(goal.obj)
