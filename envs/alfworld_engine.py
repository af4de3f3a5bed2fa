"""ALFWorld's engine, set up once per process: TextWorld's PDDL env in ALFRED's wrappers (with memos that
make resets and steps of a seen game cheap) and the Fast Downward planner on a game file. Shared by the
env (``envs.alfworld_env``) and the game generator (``envs.alfworld_gen``), which checks each drawn
game is solvable."""
from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any


def wrapped_pddl_env() -> Any:
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
    from textworld.envs import PddlEnv

    import textworld.logic
    from textworld.envs.pddl import textgen

    _memoize_translation()
    _memoize_parser(textgen)
    _memoize_parser(textworld.logic)
    infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
    return AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))


def innermost(env: Any) -> Any:
    while hasattr(env, "_wrapped_env") and env._wrapped_env is not None:
        env = env._wrapped_env
    return env


_TRANSLATIONS: OrderedDict = OrderedDict()


def _memoize_translation(max_games: int = 256) -> None:
    """Reset re-translates the PDDL problem twice (~0.6 s); the result depends only on the text, so a
    per-process memo makes resets of a seen game cheap. Fast Downward keeps its search state in its
    own library copy, not in the translated task, which is only read."""
    import fast_downward

    if getattr(fast_downward.pddl2sas, "_agentrl_memo", False):
        return
    original = fast_downward.pddl2sas

    def pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False) -> Any:
        key = (hash(domain), hash(problem), len(problem), optimize)
        if key not in _TRANSLATIONS:
            _TRANSLATIONS[key] = original(domain, problem, verbose=verbose, optimize=optimize)
            if len(_TRANSLATIONS) > max_games * 2:
                _TRANSLATIONS.popitem(last=False)
        _TRANSLATIONS.move_to_end(key)
        return _TRANSLATIONS[key]

    pddl2sas._agentrl_memo = True  # type: ignore[attr-defined]
    fast_downward.pddl2sas = pddl2sas


def _memoize_parser(module: Any) -> None:
    """TextWorld's grammar and logic re-parse the same few rule strings with TatSu for every admissible
    command on every step (~150 ms a step here). Parsing is a pure function of the string: parse once,
    hand out deep copies (derivation assigns contexts onto the symbols it gets)."""
    from copy import deepcopy

    if getattr(module._parse_and_convert, "_agentrl_memo", False):
        return
    original, memo = module._parse_and_convert, {}

    def parse_and_convert(text: str, rule_name: str = "", **kwargs: Any) -> Any:
        key = (text, rule_name)
        if key not in memo:
            if len(memo) > 50_000:
                memo.clear()
            memo[key] = original(text, rule_name=rule_name, **kwargs)
        return deepcopy(memo[key])

    parse_and_convert._agentrl_memo = True  # type: ignore[attr-defined]
    module._parse_and_convert = parse_and_convert


_PLANNER: Any = None


def plan_game(game_file: Path) -> list[str] | None:
    """ALFWorld's planner expert on a game's initial state; None if Fast Downward finds no plan.

    This is what ``AlfredExpert(expert_type="planner")`` reports at reset (``policy_commands``, i.e.
    ``PddlState.replan``), asked right after loading so no observation text has to be generated."""
    global _PLANNER
    if _PLANNER is None:  # one per process: each holds its own copy of Fast Downward's library
        _PLANNER = wrapped_pddl_env()
    try:
        _PLANNER.load(str(game_file))
        inner = innermost(_PLANNER)
        plan = inner._pddl_state.replan(inner._entity_infos)
    except Exception as e:  # the planner raises on unsolvable problems; those are filtered out
        logging.getLogger(__name__).debug("no plan for %s (%s: %s)", game_file, type(e).__name__, e)
        return None
    return list(plan) if plan else None
