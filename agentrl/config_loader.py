"""Loading a recipe: YAML with inheritance and per-env overlays, dotted overrides.

A recipe YAML may say ``base: grpo`` (deep-merged over the base recipe's YAML; every chain ends in
``recipes/base.yaml``: the dataclass defaults, with the CPU demos' tuning in its demo overlays), carry
``env_overlays: {alfworld: {...}}`` (merged when that env is chosen, over the keys of the YAML that carries
it: a child recipe's own keys beat its base's overlay; an outside suite's env such as ``gem:game:X`` takes
the suite's, ``gem``), carry ``demo_overlays: {alfworld: {models: [tiny, smollm2], ...}}`` (a CPU demo's
tuning: merged like an env overlay, but only when the run's model is one of the demo models the overlay's
``models`` lists, ``[tiny]`` if it lists none, or no model is named; any other model or a model folder gets the
recipe's own, the paper's, settings, with ``paper_overlays: {ENV: {...}}``: a paper's per-env values, merged
for every run no demo overlay of that env is for), carry ``model_overlays: {smollm2: {...}}`` (at the top or
inside an env overlay: merged when that model is chosen, by ``--model`` or ``model.name=...``: a pretrained
model wants other SFT settings than one trained from scratch), and be overridden from the command line with
``rollout.max_turns=5``-style strings (values parsed as YAML, aliases bounded). Every key is checked against
the schema (``agentrl.config``) before any work starts; a wrong key or value fails with one line naming it
and what is allowed.
"""
from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import yaml

from agentrl.config import ModelCfg, RecipeCfg, warm_start_folder
from agentrl.config_ranges import check_ranges
from agentrl.schema import ConfigError, build

RECIPE_DIR = Path(__file__).resolve().parent / "recipes"  # the repo's recipes/ (installed as agentrl/recipes)


# ------------------------------------------------------------------------------------------------------
# loading


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# A recipe resolves to a few hundred nodes; aliases may not add more than this many to a document, so a few hundred
# bytes of nested aliases ("billion laughs") cannot make every later walk over the config exponential
MAX_YAML_NODES = 20_000


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses a document whose aliases expand it by more than MAX_YAML_NODES nodes (or refer to
    the node holding them), and a mapping that gives a key twice (PyYAML keeps the last silently, so
    ``trainer: {steps: 3, steps: 5}`` ran 5 steps). A long list written out is fine: only what aliases repeat counts."""

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        self._paths = _mapping_paths(node)
        sizes: dict[int, int | None] = {}

        def size(n: yaml.Node) -> int:  # nodes in the expansion; memoized, so linear in the document's nodes
            if id(n) in sizes:
                if sizes[id(n)] is None:
                    raise ConfigError("an alias refers to the node that holds it (a recursive anchor)")
                return sizes[id(n)]  # type: ignore[return-value]
            sizes[id(n)] = None
            kids = [x for kv in n.value for x in kv] if isinstance(n, yaml.MappingNode) else \
                n.value if isinstance(n, yaml.SequenceNode) else []
            sizes[id(n)] = total = 1 + sum(size(k) for k in kids)
            return total

        if node is not None and size(node) - len(sizes) > MAX_YAML_NODES:
            raise ConfigError(f"anchors and aliases expand it by more than {MAX_YAML_NODES} nodes; write the "
                              "values out or use fewer nested aliases")
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        # checked before SafeLoader flattens merge keys (``<<: *base``), whose keys a mapping may override
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    earlier = first.setdefault(key, key_node)
                except TypeError:
                    continue  # an unhashable key: SafeLoader's own error names it
                if earlier is not key_node:
                    where = getattr(self, "_paths", {}).get(id(node), "")
                    raise ConfigError(f"duplicate key '{where}{key}': {_at(earlier)} and {_at(key_node)}; "
                                      "keep one")
        return super().construct_mapping(node, deep=deep)


def _at(node: yaml.Node) -> str:
    return f"line {node.start_mark.line + 1}, column {node.start_mark.column + 1}"


def _mapping_paths(root: yaml.Node | None) -> dict[int, str]:
    """Each mapping node's dotted path from the top (``trainer.``), so a duplicate key is named in full; a node
    reached twice through aliases keeps its first path."""
    paths: dict[int, str] = {}
    todo = [(root, "")]
    while todo:
        n, path = todo.pop()
        if n is None or id(n) in paths:
            continue
        if isinstance(n, yaml.MappingNode):
            paths[id(n)] = path
            todo += [(v, f"{path}{k.value}." if isinstance(k, yaml.ScalarNode) else path) for k, v in n.value]
        elif isinstance(n, yaml.SequenceNode):
            paths[id(n)] = path
            todo += [(v, path) for v in n.value]
    return paths


def load_yaml(text: str, what: str) -> Any:
    """``text`` parsed as YAML (safe types only, aliases bounded); one ConfigError line naming ``what`` otherwise."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506  (a SafeLoader subclass)
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from None
    except yaml.MarkedYAMLError as e:  # a tab, an unclosed bracket: PyYAML knows where
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{what}: malformed YAML{where}: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what}: malformed YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"{what}: YAML nested too deeply") from None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the recipe YAML: {e}") from None
    # parsed once per text: a suite resolves hundreds of configs, each reading its recipe chain, and the pure-Python
    # parser takes ~0.1 s a file; the copy keeps the cached tree from the resolver's pops and merges
    data = copy.deepcopy(_parsed(text, str(path)))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe YAML must be a mapping, got {type(data).__name__}")
    return data


@functools.lru_cache(maxsize=256)
def _parsed(text: str, what: str) -> Any:
    return load_yaml(text, what) or {}


def is_import_path(name: str) -> bool:
    """``package.module:Name``: user code named where a registered name may stand (not a YAML file)."""
    return ":" in name and Path(name).suffix not in (".yaml", ".yml")


def lookup(registry: Any, name: str, key: str, where: str = "for") -> Any:
    """``registry.get(name)`` (a registered name or an import path), its error as one line naming the
    config key."""
    from agentrl.registry import RegistryError

    if not is_import_path(name) and name not in registry:
        raise ConfigError(f"bad value {where} '{key}': {name!r}; allowed: {', '.join(registry.names())} (or an "
                          "import path package.module:name)")
    try:
        return registry.get(name)
    except RegistryError as e:
        raise ConfigError(f"bad value {where} '{key}': {e}") from None


def recipe_yaml(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    cand = RECIPE_DIR / f"{name_or_path}.yaml"
    if not cand.exists():
        known = sorted(x.stem for x in RECIPE_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown recipe '{name_or_path}'; allowed: {', '.join(known)} (or a path to a .yaml, or "
                          "a recipe class package.module:Class)")
    return cand


DEMO_MODELS = ("tiny",)  # a demo overlay's models when it lists none
DEMO_RUN = "__demo_run__"  # set in a resolved YAML when a demo overlay of its env is for the run's model


def is_demo_model(model: str | None, models: Any) -> bool:
    """Whether a demo overlay listing ``models`` applies to a run of ``model`` (None: the recipe's own model,
    the demo's); ``tiny:hidden_size=256`` is a sized ``tiny``."""
    if model is None:
        return True
    model = demo_model_of(model)
    return any(model == m or model.startswith(f"{m}:") for m in models)


def demo_model_of(model: str) -> str:
    """The demo model a folder holds (its config.json's ``agentrl_model``: agentrl's tiny and SmolLM2 builds
    write it and every export keeps it, so a demo run's warm start is still the demo model); else ``model``."""
    try:
        return str(json.loads((Path(model).expanduser() / "config.json").read_text()).get("agentrl_model") or model)
    except (OSError, ValueError, AttributeError):
        return model


def _env_overlay(path: Path, data: dict[str, Any], key: str, env: str) -> dict[str, Any] | None:
    overlays = data.pop(key, None) or {}
    if not isinstance(overlays, dict):
        raise ConfigError(f"{path}: {key} must map env names to sections, got {type(overlays).__name__}")
    # an outside suite's envs ("gem:game:GuessTheNumber-v0") also take the suite's overlay ("gem"); a wrapped
    # env ("latency:sokoban") takes its inner env's, so a benchmark runs the same settings with delays added
    inner = env.split(":", 1)[1] if env.startswith("latency:") else env
    overlay = overlays.get(inner, overlays.get(inner.split(":")[0]) if ":" in inner else None)
    if overlay is not None and not isinstance(overlay, dict):
        raise ConfigError(f"{path}: {key}.{env} must be a mapping of sections, got {type(overlay).__name__}")
    return overlay


def resolve_yaml(name_or_path: str, seen: tuple[str, ...] = (), env: str | None = None,
                 model: str | None = None, demo: bool = True) -> dict[str, Any]:
    """The recipe's YAML with its ``base`` chain merged in (base first). With ``env``, each level's overlay
    for that env is applied right after that level's own keys, so a recipe's own setting beats an overlay
    it inherits (``leafe`` says ``trainer.steps: 1``; its base's alfworld overlay must not make that 10).
    A level's demo overlay for ``env`` follows its env overlay when ``demo`` and ``model`` is one of its models.

    A recipe class of the user's (``mypkg.mod:MyRecipe``) takes the settings of the YAML its ``base``
    attribute names; a YAML names its class with ``recipe: mypkg.mod:MyRecipe`` (or ``method:``)."""
    from agentrl.recipe import RECIPES

    if is_import_path(name_or_path):
        cls = lookup(RECIPES, name_or_path, "recipe")
        data = resolve_yaml(getattr(cls, "base", "base"), seen + (name_or_path,), env, model, demo)
        return dict(data, method=name_or_path, recipe=cls.__name__.lower())
    path = recipe_yaml(name_or_path)
    if str(path) in seen:
        raise ConfigError(f"recipe inheritance loop: {' -> '.join(seen + (str(path),))}")
    data = _read_yaml(path)
    own_class = data.pop("recipe") if is_import_path(str(data.get("recipe", ""))) else None
    own_method = own_class or data.get("method") or (path.stem if path.stem in RECIPES else None)
    base = data.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{path}: bad value for 'base': {base!r}; allowed: a recipe name (e.g. base: grpo) or a "
                          "path to a .yaml")
    env_over = dem = paper = None
    demo_run = False  # whether this level's demo overlay is for the run's model
    if env is not None:
        env_over = _env_overlay(path, data, "env_overlays", env)
        paper = _env_overlay(path, data, "paper_overlays", env)
        dem = _env_overlay(path, data, "demo_overlays", env)
        if dem is not None:
            dem = dict(dem)
            models = dem.pop("models", DEMO_MODELS)
            if not isinstance(models, list | tuple) or not all(isinstance(m, str) for m in models):
                raise ConfigError(f"{path}: demo_overlays.{env}.models must be a list of model names, got {models!r}")
            demo_run = is_demo_model(model, models)
    if base:
        data = deep_merge(resolve_yaml(base, seen + (str(path),), env, model, demo), data)
    demo_run = demo_run or bool(data.pop(DEMO_RUN, False))
    # paper_overlays: a paper's per-env values, for every run the demo's tuning is not for
    for overlay in (env_over, None if demo_run else paper, dem if demo and demo_run else None):
        if overlay:
            data = deep_merge(data, overlay)
    if demo_run:
        data[DEMO_RUN] = True
    # A recipe's YAML names its own class; a user's YAML derived from it inherits the base's class.
    data["method"] = own_method or data.get("method") or path.stem
    data["recipe"] = path.stem
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key.sub=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.load(raw, Loader=_BoundedLoader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError:
        value = raw  # not YAML: the text itself (a path with a colon, say)
    except ConfigError as e:
        raise ConfigError(f"override '{key.strip()}': {e}") from None
    except RecursionError:
        raise ConfigError(f"override '{key.strip()}': YAML nested too deeply") from None
    return key.strip().split("."), value


def load_config(recipe: str, env: str | None = None, overrides: list[str] | tuple[str, ...] = (),
                model: str | None = None) -> RecipeCfg:
    return _load(recipe, env, overrides, model)


def _load(recipe: str, env: str | None, overrides: list[str] | tuple[str, ...], model: str | None,
          demo: bool = True, model_overlays: bool = True) -> RecipeCfg:
    chosen_env = env or resolve_yaml(recipe).get("env", RecipeCfg.env)
    parsed = [(text, *parse_override(text)) for text in overrides]
    chosen = _chosen_model(recipe, chosen_env, parsed, model)
    data = resolve_yaml(recipe, env=chosen_env, model=chosen, demo=demo)
    data.pop(DEMO_RUN, None)
    name = data["recipe"]
    data["env"] = chosen_env
    if model:
        data.setdefault("model", {})["name"] = model
    if model_overlays:
        data = _apply_model_overlay(data, parsed)
    else:
        data.pop("model_overlays", None)
    for text, keys, value in parsed:
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{text}': '{k}' is not a section")
        node[keys[-1]] = value
    data["recipe"] = name
    cfg = build(RecipeCfg, data, "")
    _check_names(cfg)
    return cfg


def _chosen_model(recipe: str, env: str, parsed: list[tuple[str, list[str], Any]], model: str | None) -> str | None:
    """The model a run names (``--model``, then ``model.name=``, then a user YAML's ``model.name``); None when it
    names none, so the recipe's own (demo) model runs."""
    for _, keys, value in parsed:
        if keys == ["model", "name"]:
            model = str(value)
    if model is None:
        named = (resolve_yaml(recipe, env=env, demo=False).get("model") or {}).get("name")
        model = named if isinstance(named, str) else None
    return model


def config_sources(recipe: str, env: str | None = None, overrides: list[str] | tuple[str, ...] = (),
                   model: str | None = None, defaults: bool = True) -> dict[str, str]:
    """Where each resolved value came from: ``recipe`` (the recipe YAML chain, its env and paper overlays: the
    papers' settings, each traced in a comment), ``demo overlay`` (a CPU demo's tuning, for the demo models
    only), ``model overlay``, ``user`` (``--model``, the command line) or ``default`` (the config dataclass's
    or the recipe class's ``extra`` default: set by nobody). ``defaults=False`` leaves the defaults out."""
    layers = [("recipe", _load(recipe, env, (), None if model is None else model, demo=False,
                               model_overlays=False)),
              ("demo overlay", _load(recipe, env, (), model, model_overlays=False)),
              ("model overlay", _load(recipe, env, (), model)),
              ("user", _load(recipe, env, overrides, model))]
    prev = flat_config(RecipeCfg())
    out: dict[str, str] = {}
    for label, cfg in layers:
        now = flat_config(cfg)
        for k, v in now.items():
            if k not in prev or prev[k] != v:
                out[k] = label
        prev = now
    for key, given in (("model.name", model), ("env", env)):
        if given is not None:
            out[key] = "user"
    if defaults:
        out = {k: out.get(k, "default") for k in resolved_values(layers[-1][1])}
    return out


def resolved_values(cfg: RecipeCfg) -> dict[str, Any]:
    """``flat_config`` with the recipe class's ``extra`` defaults filled in: every value the run uses."""
    from agentrl.recipe import RECIPES

    out = flat_config(cfg)
    params = getattr(lookup(RECIPES, cfg.method, "method"), "Params", None)
    if params is not None:
        for k, v in flat_config_of(build(params, cfg.extra, "extra.")).items():
            out.setdefault(f"extra.{k}", v)
    return out


def flat_config_of(params: Any) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def flat_config(cfg: RecipeCfg) -> dict[str, Any]:
    """The config as ``section.key: value`` (``extra`` and ``env_kwargs`` by their own keys)."""
    out: dict[str, Any] = {}

    def walk(d: dict[str, Any], prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[prefix + k] = v

    walk(cfg.to_dict(), "")
    return out


def _apply_model_overlay(data: dict[str, Any], parsed: list[tuple[str, list[str], Any]]) -> dict[str, Any]:
    """Merge ``model_overlays[<chosen model>]`` under the command line's overrides (which still win)."""
    overlays = data.pop("model_overlays", None) or {}
    if not isinstance(overlays, dict):
        raise ConfigError(f"model_overlays must map model names to sections, got {type(overlays).__name__}")
    name = (data.get("model") or {}).get("name", ModelCfg.name)
    for _, keys, value in parsed:
        if keys == ["model", "name"]:
            name = value
    # a model folder's path gets none, unless the folder holds a demo model (its config.json's agentrl_model:
    # a tiny build or its export), which takes that model's overlays as it takes its demo overlays
    overlay = (overlays.get(name, overlays.get(demo_model_of(name))) if isinstance(name, str) else None)
    if overlay is None:
        return data
    if not isinstance(overlay, dict):
        raise ConfigError(f"model_overlays.{name} must be a mapping of sections, got {type(overlay).__name__}")
    if "name" in (overlay.get("model") or {}):
        raise ConfigError(f"model_overlays.{name} must not set model.name: it is chosen by that name")
    return deep_merge(data, overlay)


# ------------------------------------------------------------------------------------------------------
# validation


def _check_names(cfg: RecipeCfg) -> None:
    from agentrl.algos.advantages import ESTIMATORS
    from agentrl.algos.filters import FILTERS
    from agentrl.algos.losses import LOSSES
    from agentrl.curriculum.task_sampler import TASK_SAMPLERS
    from agentrl.recipe import RECIPES
    from agentrl.envs import registry

    check_ranges(cfg)  # every numeric key's range, before any rule reads the values
    cls = lookup(RECIPES, cfg.method, "method")
    params = getattr(cls, "Params", None)
    if params is None and cfg.extra:
        raise ConfigError(f"unknown key 'extra.{next(iter(cfg.extra))}': recipe method '{cfg.method}' "
                          "takes no extra keys")
    p = build(params, cfg.extra, "extra.") if params is not None else None
    if hasattr(cls, "check_config"):  # the recipe's own rules (Recipe.check_config)
        cls.check_config(cfg, p)
    est = lookup(ESTIMATORS, cfg.algo.estimator, "algo.estimator")
    lookup(LOSSES, cfg.algo.loss, "algo.loss")
    if est.needs_values and not est.token_level and cfg.algo.level == "trajectory":
        raise ConfigError(f"'algo.estimator: {cfg.algo.estimator}' trains a critic on turns: it needs "
                          "'algo.level: turn' (for a critic over whole full-chat episodes use gae_token)")
    if est.token_level and (cfg.algo.level != "trajectory" or cfg.rollout.chat_mode != "full"):
        raise ConfigError(f"'algo.estimator: {cfg.algo.estimator}' is token-level GAE over whole multi-turn "
                          "episodes: it needs 'algo.level: trajectory' and 'rollout.chat_mode: full'")
    for f in cfg.algo.filters:
        lookup(FILTERS, f, "algo.filters", where="in")
    if cfg.env not in registry.names() and ":" not in cfg.env:
        raise ConfigError(f"bad value for 'env': {cfg.env!r}; allowed: {', '.join(registry.names())}")
    if "tool_parser" in cfg.env_kwargs:  # a tool env's or an agent program's call format
        _check_tool_parser(cfg.env_kwargs["tool_parser"])
    if cfg.env.startswith("agent:"):  # an agent program's numeric options (failure_reward, timeout_s, ...)
        from agentrl.envs.agent_program import check_gate, check_options
        from agentrl.envs.base import EnvError

        program = cfg.env.split(":", 1)[1]
        if program.split(":", 1)[0] in ("__main__", "__mp_main__"):  # each worker's __main__ is its own
            raise ConfigError(f"bad value for 'env': {cfg.env!r}: agent programs run in worker processes, which "
                              "cannot import the launching script's __main__; put the function in a module and "
                              "name it (agent:mymodule:fn)")

        try:
            check_options(cfg.env_kwargs)
            # agent:external's key, address and command per episode, here so --print-config and --dry-run
            # refuse what the run would (the env checks of preflight need the run's machine)
            check_gate(cfg.env.split(":", 1)[1], *(cfg.env_kwargs.get(k) for k in ("host", "port", "command")))
        except EnvError as e:
            raise ConfigError(str(e)) from None
    if cfg.trainer.device not in ("auto", "cpu", "cuda") and not cfg.trainer.device.startswith("cuda:"):
        raise ConfigError(f"bad value for 'trainer.device': {cfg.trainer.device!r}; allowed: auto, cpu, cuda, cuda:N")
    if cfg.rollout.constrain_actions and cfg.rollout.require_think:
        raise ConfigError("rollout.constrain_actions decodes the answer alone; set rollout.require_think=false")
    if cfg.eval.samples > 1 and cfg.eval.temperature <= 0:
        raise ConfigError(f"eval.samples={cfg.eval.samples} at eval.temperature={cfg.eval.temperature}: greedy "
                          "samples are all the same, so pass@k would equal pass@1; set eval.temperature "
                          "(e.g. eval.temperature=1.0, independent samples from the policy) or eval.samples=1")
    s = cfg.sft
    if s.warm_start and warm_start_folder(cfg) is None:
        raise ConfigError(f"bad value for 'sft.warm_start': {s.warm_start!r} is not a model folder (no "
                          "config.json); give a run's warm_start folder (RUN/warm_start), or drop the key "
                          "to make a warm start")
    if cfg.algo.critic_path and not (Path(cfg.algo.critic_path).expanduser() / "config.json").is_file():
        raise ConfigError(f"bad value for 'algo.critic_path': {cfg.algo.critic_path!r} is not a model folder (no "
                          "config.json); give an HF model folder, or drop the key to start the critic from the policy")
    if s.constrain_actions and not cfg.rollout.constrain_actions:
        raise ConfigError("sft.constrain_actions fits the policy that constrained decoding samples from; set "
                          "rollout.constrain_actions=true too, or sft.constrain_actions=false for free decoding")
    if s.max_epochs > s.epochs:
        if s.select_split == cfg.eval.split:
            raise ConfigError(f"sft.select_split={s.select_split} is also eval.split: choosing the warm start's "
                              "passes on the evaluation tasks would leak them; pick another split")
        if s.schedule != "constant":
            raise ConfigError(f"sft.max_epochs={s.max_epochs} with sft.schedule={s.schedule}: a decaying lr "
                              "needs a known number of passes; use sft.schedule=constant or drop sft.max_epochs")
    a = cfg.algo
    if a.progress_coef and a.reward == "env_return":
        raise ConfigError(f"bad value for 'algo.progress_coef': {a.progress_coef}; allowed: >= 0, added to "
                          "algo.reward=success or score (env_return takes the env's own step rewards)")
    r = cfg.rollout
    lookup(TASK_SAMPLERS, r.task_sampler, "rollout.task_sampler")
    _check_contradictions(cfg)


# estimators whose advantage is relative to the rest of the episode's group: zero (or undefined) in a group of one
GROUP_RELATIVE = ("grpo", "dr_grpo", "rloo", "gigpo", "gigpo_dr", "reinforce_pp_baseline")


def _check_tool_parser(name: Any) -> None:
    """``env_kwargs.tool_parser`` names a parser (a number, a plain function or the base class gave a 65-line
    traceback at the first turn; an unknown name was refused only after the run folder was made)."""
    from agentrl.registry import RegistryError
    from agentrl.rollout.tool_formats import tool_parser

    try:
        tool_parser(name)
    except (RegistryError, ValueError) as e:
        raise ConfigError(f"bad value for 'env_kwargs.tool_parser': {e}") from None


def _check_contradictions(cfg: RecipeCfg) -> None:
    """Settings that each make sense but not together: one line naming both keys."""
    r, a = cfg.rollout, cfg.algo
    if r.group_size == 1:
        why = "rollout.group_size=1: a group of one never has reward variance"
        if r.fill_groups > 0:
            raise ConfigError(f"rollout.fill_groups={r.fill_groups} (dynamic sampling) waits for groups with reward "
                              f"variance, and {why}; set rollout.fill_groups=0 or rollout.group_size >= 2")
        for f in a.filters:
            if f in ("variance", "zero_variance"):
                raise ConfigError(f"algo.filters has '{f}', which drops groups without reward variance, and {why}; "
                                  f"drop '{f}' from algo.filters or set rollout.group_size >= 2")
        if a.estimator in GROUP_RELATIVE:
            raise ConfigError(f"algo.estimator={a.estimator} is relative to the episode's group, and {why}; set "
                              "rollout.group_size >= 2, or a batch-wide estimator (gae, reinforce_pp)")
    if a.kl == "none" and a.kl_coef > 0:
        raise ConfigError(f"algo.kl_coef={a.kl_coef} has no effect with algo.kl=none; choose the estimator "
                          "(algo.kl=k1, k2 or k3) or set algo.kl_coef=0")
    if a.level == "trajectory" and a.mini_batch_samples == 0 and a.mini_batches > r.groups * r.group_size:
        raise ConfigError(f"algo.mini_batches={a.mini_batches} is more than the {r.groups * r.group_size} episodes a "
                          f"step trains on at algo.level=trajectory (rollout.groups x rollout.group_size); lower "
                          "algo.mini_batches or raise rollout.groups")
    t = cfg.trainer
    if t.vllm_gpus and t.generator == "vllm" and not t.generator_url and len(t.vllm_gpus) < t.vllm_servers:
        raise ConfigError(f"trainer.vllm_gpus lists {len(t.vllm_gpus)} device sets for trainer.vllm_servers="
                          f"{t.vllm_servers}: give one per server (e.g. trainer.vllm_gpus=[6,7]) or start fewer")
    if t.max_staleness > 1 and t.generator == "remote":
        raise ConfigError(f"trainer.max_staleness={t.max_staleness} with trainer.generator=remote: `agentrl serve` "
                          "loads the weights the learner exports, its current ones, so it cannot be handed older "
                          "staged ones; use trainer.max_staleness=1, the embedded generator or vLLM servers")
    if t.inflight_updates and t.max_staleness == 0:
        raise ConfigError("trainer.inflight_updates=true loads new weights while a collect runs, and "
                          "trainer.max_staleness=0 collects only between updates; set trainer.max_staleness >= 1")
    if t.inflight_updates and t.generator == "remote":
        raise ConfigError("trainer.inflight_updates=true with trainer.generator=remote: `agentrl serve` loads the "
                          "weights the learner exports between collects; use the embedded generator or vLLM servers, "
                          "or trainer.inflight_updates=false")
    from agentrl.generation.backends import GENERATORS

    lookup(GENERATORS, t.generator, "trainer.generator")  # a user's backend: its import fails here, in one line
    if r.mode == "continuous":
        _check_continuous(cfg)
    why = _overlap_refusal(cfg.method) if t.max_staleness > 0 else ""
    if why:
        raise ConfigError(f"trainer.max_staleness={t.max_staleness} collects later steps while this one learns, and "
                          f"method={cfg.method} cannot: {why}; set trainer.max_staleness=0")
    _check_engine_and_generator(cfg)


def _check_engine_and_generator(cfg: RecipeCfg) -> None:
    """The learner engine and the generator each refuse some settings of the others, whatever the machine."""
    from agentrl.generation.vllm import LORA_RANKS

    t, m = cfg.trainer, cfg.model
    if t.engine == "deepspeed" and m.compile:
        raise ConfigError("model.compile under trainer.engine=deepspeed is not supported (ZeRO-3 gathers "
                          "parameters in hooks around each module); use trainer.engine=torch to compile")
    if t.generator == "remote" and not t.generator_url:
        raise ConfigError("trainer.generator=remote needs trainer.generator_url")
    if t.generator == "vllm" and not t.generator_url and t.vllm_servers < 1:
        raise ConfigError("trainer.generator=vllm needs trainer.generator_url or trainer.vllm_servers >= 1")
    if t.generator == "vllm" and m.lora_r > LORA_RANKS[-1]:
        raise ConfigError(f"bad value for 'model.lora_r': {m.lora_r}; vLLM serves LoRA ranks up to "
                          f"{LORA_RANKS[-1]} (trainer.generator=vllm)")
    if cfg.vllm.colocate and t.vllm_sync == "nccl":  # the launch plan's layout says the same
        raise ConfigError("trainer.vllm_sync=nccl cannot reach servers on the learner's GPUs (vllm.colocate=true): "
                          "NCCL refuses two ranks on one GPU; use trainer.vllm_sync=auto (CUDA IPC)")


def _check_continuous(cfg: RecipeCfg) -> None:
    """``rollout.mode: continuous`` (agentrl.rollout.continuous): what it cannot run, one line each."""
    from agentrl.recipe import RECIPES

    t, r = cfg.trainer, cfg.rollout
    head = "rollout.mode=continuous trains on groups drawn while earlier updates ran"
    if t.max_staleness < 1:
        raise ConfigError(f"{head}, so it needs trainer.max_staleness >= 1 (no token older than that many versions "
                          "is trained on); set trainer.max_staleness=1 or more")
    if t.generator not in ("embedded", "vllm"):  # the population's updates land mid-episode
        raise ConfigError(f"{head}, with a generator that takes weights mid-episode: trainer.generator=embedded "
                          f"or vllm (got {t.generator}); use rollout.mode=async with trainer.max_staleness")
    if r.task_sampler != "uniform":
        raise ConfigError(f"{head}, and rollout.task_sampler={r.task_sampler} draws each collect's tasks from the "
                          "collects before it; use rollout.task_sampler=uniform")
    why = lookup(RECIPES, cfg.method, "method").continuous_refusal()
    if why:
        raise ConfigError(f"{head}, and method={cfg.method} cannot take its groups from the running population: "
                          f"{why}; use rollout.mode=async with trainer.max_staleness")


def _overlap_refusal(method: str) -> str:
    from agentrl.recipe import RECIPES

    return lookup(RECIPES, method, "method").overlap_refusal()
