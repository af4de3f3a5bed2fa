"""One schema: a config key has one default, in ``agentrl.config``. A dataclass elsewhere in the package that
mirrors a config section (shares at least three of its field names: an engine's, the rollout's or the losses'
view of it) must give each key it shares with that section, or with the one section that has the name, that
section's default, so a view built without the config behaves as the config says."""
import dataclasses
import importlib
import inspect
import pkgutil

import pytest

import agentrl
from agentrl import config


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _dataclasses():
    for m in pkgutil.walk_packages(agentrl.__path__, "agentrl."):
        try:
            mod = importlib.import_module(m.name)
        except ImportError:  # an optional dependency (vLLM, Ray, an env's package) absent here
            continue
        for cls in vars(mod).values():
            if inspect.isclass(cls) and dataclasses.is_dataclass(cls) and cls.__module__ == m.name:
                yield cls


# fields of a view that share a key's name but not its meaning
OTHER_MEANING = {
    ("EngineConfig", "device"): "the device trainer.device resolved to",
    ("SamplingParams", "seed"): "one request's sampling seed, not trainer.seed",
}


@pytest.mark.slow  # imports every module of the package
def test_no_two_dataclasses_give_one_config_key_two_defaults():
    from agentrl.recipe import RECIPES

    sections = [c for c in vars(config).values() if inspect.isclass(c) and dataclasses.is_dataclass(c)
                and c.__module__ == "agentrl.config" and c is not config.RecipeCfg]
    defaults = {sec: {f.name: _default(f) for f in dataclasses.fields(sec)} for sec in sections}
    owners: dict[str, list] = {}
    for sec, keys in defaults.items():
        for k in keys:
            owners.setdefault(k, []).append(sec)
    # a recipe's own knobs are keys of their own (extra.*), not views of a section
    params = {RECIPES.get(n).Params for n in RECIPES.names()} - {None}
    clashes, views = [], set()
    for cls in set(_dataclasses()) - set(sections) - params:
        mine = {f.name: _default(f) for f in dataclasses.fields(cls) if (cls.__name__, f.name) not in OTHER_MEANING}
        mirrored = [sec for sec in sections if len(set(mine) & set(defaults[sec])) >= 3]
        if not mirrored:
            continue
        views.add(cls.__name__)
        for k, v in sorted(mine.items()):
            for sec in owners.get(k, []):
                if (sec in mirrored or len(owners[k]) == 1) and dataclasses.MISSING not in (v, defaults[sec][k]) \
                        and v != defaults[sec][k]:
                    clashes.append(f"{cls.__module__}.{cls.__name__}.{k} = {v!r}, {sec.__name__}.{k} = "
                                   f"{defaults[sec][k]!r}")
    assert not clashes, "one key, two defaults:\n" + "\n".join(clashes)
    assert {"RolloutConfig", "OptimConfig", "EngineConfig", "SamplingParams"} <= views  # the check sees the views
