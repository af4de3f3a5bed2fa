"""Recipe configuration: typed dataclasses, YAML with inheritance and per-env overlays, dotted overrides.

A recipe YAML may say ``base: grpo`` (deep-merged over the base recipe's YAML; every chain ends in
``recipes/base.yaml``: the dataclass defaults, with the CPU demos' tuning in its env overlays), carry
``env_overlays: {alfworld: {...}}`` (merged when that env is chosen, over the keys of the YAML that carries
it: a child recipe's own keys beat its base's overlay; an outside suite's env such as ``gem:game:X`` takes
the suite's, ``gem``), carry ``model_overlays: {smollm2: {...}}`` (at the top or inside an env overlay:
merged when that model is chosen, by ``--model`` or ``model.name=...``: a pretrained model wants other SFT
settings than one trained from scratch), and be overridden from the command line with
``rollout.max_turns=5``-style strings (values parsed as YAML, aliases bounded). Every key is checked against
the schema below before any work starts; a wrong key or value fails with one line naming it and what is allowed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from agentrl.schema import ConfigError, build  # noqa: F401  (ConfigError: re-exported for callers)

RECIPE_DIR = Path(__file__).resolve().parent / "recipes"  # the repo's recipes/ (installed as agentrl/recipes)


@dataclass
class ModelCfg:
    name: str = "tiny"  # tiny | tiny:KEY=N,... (sized) | smollm2 | path to an HF folder
    dtype: str = "float32"
    lora_r: int = 0  # > 0 turns LoRA on
    lora_alpha: int = 16
    # "bf16": the torch engine trains under bf16 autocast (fp32 weights and rollouts; ~2x faster updates
    # on CPUs with AVX512-BF16). "": plain dtype
    autocast: Literal["", "bf16"] = ""
    # torch.compile the learner's decoder (dynamic shapes): a small model's step on a GPU is bound by the
    # operators it dispatches, which compiling fuses (docs/gpu.md); the first step pays the compile
    compile: bool = False


@dataclass
class RolloutCfg:
    groups: int = 4  # distinct start states per step
    group_size: int = 4  # rollouts per start state (G)
    slots: int = 16  # env slots rolled out together
    refill: bool = False  # a slot takes the next start when its episode ends (no waves; same episodes, fewer calls)
    # "async": each episode advances on its own, no per-turn barrier (same episodes; docs/guides/async.md)
    mode: Literal["lockstep", "async"] = "lockstep"
    pool: Literal["inprocess", "process", "ray"] = "inprocess"
    ray_slots_per_actor: int = 1  # pool=ray: env slots per Ray actor (one worker process; docs/guides/ray.md)
    ray_num_cpus: float = 1.0  # pool=ray: CPUs each actor reserves on its node (Ray's scheduler places it)
    ray_memory_mb: int = 0  # pool=ray: memory each actor reserves, MiB (0: none declared)
    # pool=ray: custom resources each actor needs, e.g. {env_node: 1} pins env workers to nodes offering them
    ray_resources: dict[str, float] = field(default_factory=dict)
    max_turns: int = 8
    history_len: int = 2
    chat_mode: Literal["window", "full"] = "window"
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 48
    require_think: bool = False
    format_penalty: float = -0.1
    max_actions_per_turn: int = 0  # actions one response may take (0: the env's own, e.g. Sokoban 1)
    max_episode_actions: int = 0  # actions an episode may take in all, then it is truncated (0: no cap)
    # per turn whose actions changed nothing (same env fingerprint before and after); a shaping term
    ineffective_penalty: float = 0.0
    show_admissible: bool = True
    # decode only answers among the env's admissible actions (a trie over their tokens masks every other
    # token); the learner renormalizes over the same tokens. Every generator: ours in-process or served,
    # vLLM through our logits processor
    constrain_actions: bool = False
    # "compact": the react template's task, history, observation and admissible actions without its
    # boilerplate sentences (ALFWorld: ~40% fewer prompt tokens, so SFT and RL steps cost that much less);
    # "compact_tried": compact, with the actions tried so far on their own line and left out of "Actions:";
    # "numbered": every admissible action numbered (untried first), the policy answers with a number
    prompt: Literal["paper", "compact", "compact_tried", "numbered"] = "paper"
    split: Literal["train", "valid", "test"] = "train"
    # DAPO's dynamic sampling: after a round of ``groups`` starts, roll out more rounds until this many
    # groups have reward variance (the ones with a group-relative gradient), at most ``max_rounds`` rounds
    # in all. 0: one round.
    fill_groups: int = 0
    max_rounds: int = 3
    # which tasks fresh groups start from: "uniform" (at random from the split) or "learnability" (a share
    # of each round replays levels whose last group had reward variance; agentrl/curriculum/task_sampler.py)
    task_sampler: str = "uniform"
    frontier_share: float = 0.5  # learnability: the share of a round's groups drawn from the frontier
    frontier_size: int = 256  # learnability: the most levels kept in the frontier (the oldest leave first)


@dataclass
class AlgoCfg:
    estimator: str = "grpo"
    level: Literal["turn", "trajectory"] = "turn"  # window-mode turns, or whole full-chat episodes
    # turn level: "episode" divides each turn's advantage by its episode's number of turns, so every
    # trajectory weighs the same; "uniform" lets long (often failed) episodes outweigh short ones
    turn_weight: Literal["uniform", "episode"] = "uniform"
    reward: Literal["score", "success", "env_return"] = "success"
    # success/score plus coef x the env's progress at the episode's end (Sokoban: the share of the
    # box-to-target distance closed), so that a group whose every episode fails still ranks them
    progress_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 1.0
    whiten: bool = False  # advantages normalized to mean 0, std 1 over the batch (verl's PPO does this to GAE)
    gigpo_step_weight: float = 1.0
    # the policy surrogate, from agentrl.algos.losses.LOSSES: ppo | gspo (set eps_low/high to ~3e-4/4e-4) |
    # cispo | kl_cov
    loss: str = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    kl: Literal["k1", "k2", "k3", "none"] = "none"  # a KL term in the loss (kl_coef x the estimator)
    kl_coef: float = 0.0
    # KL as a reward penalty: an episode's reward minus coef x its k1 KL to the reference policy
    kl_reward_coef: float = 0.0
    kl_reward_target: float | None = None  # adaptive coefficient steering the KL per episode toward this
    kl_reward_horizon: int = 10_000  # the adaptive controller's horizon, in episodes
    entropy_coef: float = 0.0
    clip_cov_ratio: float = 0.0
    kl_cov_ratio: float = 2e-3  # loss kl_cov: the fraction of tokens penalized
    kl_cov_coef: float = 1.0  # loss kl_cov: the weight of |log r| on them
    ppo_epochs: int = 1
    # optimizer steps per epoch: the batch is shuffled and split into this many mini-batches (verl's
    # ppo_mini_batch_size). One full-batch step per RL step left the tiny model all but unmoved in 15 steps.
    mini_batches: int = 1
    # > 0: mini-batches of about this many samples instead (ceil(samples / this) of them), so a step left
    # with few informative samples after the filters takes fewer optimizer steps, not as many on less data
    mini_batch_samples: int = 0
    value_coef: float = 0.5
    value_clip: float | None = 0.2
    # the critic of value-based estimators (gae, gae_token): "separate", a network of its own (its own
    # optimizer and lr, as verl and OpenRLHF); "shared", a value head on the policy (the value loss trains it too)
    critic: Literal["separate", "shared"] = "separate"
    # algo.critic=separate: an HF model folder whose transformer starts the critic; empty: the policy's weights
    critic_path: str = ""
    filters: list[str] = field(default_factory=lambda: ["dropped"])
    variance_keep: float = 1.0  # fraction of groups kept by the variance filter (when listed)
    # what the variance filters and dynamic sampling test for variance: the reward as trained on, or the
    # episode's outcome alone (success or score, without penalties or progress). With per-turn shaping
    # nearly every group's rewards differ, so "reward" keeps every group and dynamic sampling stops at once
    filter_on: Literal["reward", "outcome"] = "reward"


@dataclass
class OptimCfg:
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    warmup_steps: int = 0
    # lr over the RL steps: "linear"/"cosine" decay it to 0 by trainer.steps (set once per RL step, so a
    # resumed run picks it up where it was)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    token_budget: int = 16384
    # algo.critic=separate: the critic's learning rate, constant (0: optim.lr); RAGEN's critic runs at 10x the actor's
    critic_lr: float = 0.0


@dataclass
class SFTCfg:
    enabled: bool = False  # warm start on expert demonstrations before RL
    demos: int = 64  # expert episodes (train split)
    epochs: int = 2
    batch_size: int = 16
    lr: float = 1e-3
    # lr over the SFT steps: "linear"/"cosine" decay it to 0 by the last step, so the warm start ends on
    # small updates rather than wherever the last full-lr batches left it
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    # processes playing the expert demonstrations (the same episodes for any number); 0: one per core, at most 8
    workers: int = 1
    # DART: each demo step executes a random admissible action with this probability; every state keeps
    # the expert's action as its target, so the policy also learns to get back on track
    noise: float = 0.0
    group_by_length: bool = False  # batches of similar prompt lengths (less padding; another shuffle)
    # > epochs: after pass `epochs`, keep making passes (up to this many) while greedy success on
    # `select_tasks` tasks of `select_split` rises; never the evaluation split, so RL's held-out stays unseen
    max_epochs: int = 0
    select_split: Literal["train", "valid", "test"] = "test"
    select_tasks: int = 200
    select_patience: int = 2  # readings in a row without a new best before stopping (200 tasks read +-3 points)
    # passes between selection readings after pass `epochs` (0.25: every quarter pass, so SFT can stop
    # mid-pass; on Sokoban a quarter pass still moved success by up to 13 points: docs/make_train_seeds.md)
    select_every: float = 1.0
    # the warm start: the pass with the best selection reading (kept when reached), or the last pass made
    select_keep: Literal["best", "last"] = "best"
    # > 0: stop by competence instead of plateau: passes after `epochs` go on (up to max_epochs; none when
    # max_epochs <= epochs) only while the selection reading is below this, and the warm start is the last
    # pass made. On a steep SFT curve a fixed pass count leaves a lagging seed far below the others
    # (docs/make_train_seeds.md)
    target_success: float = 0.0
    # RL starts with a fresh optimizer state: Adam's second moments carried over from SFT, whose gradients
    # are several times RL's, shrink RL's updates ~4x for hundreds of steps (docs/make_train_seeds.md)
    reset_optimizer: bool = False
    # passes made after SFT has stopped (after the selection rule and its best pass), the lr decaying
    # linearly from sft.lr to 0: the warm start ends annealed instead of wherever full-lr batches left it
    cooldown: int = 0
    # a warm start saved by an earlier run (RUN/warm_start, made with the same model.name): this run starts
    # from its weights and makes none (no demonstrations, no SFT), so methods and seeds compared on a GPU,
    # where the same seed does not give the same SFT, start from the very same weights
    warm_start: str = ""
    # the seed that picks the demonstration tasks and their expert draws; -1: the run's seed
    demo_seed: int = -1
    # the seed that shuffles SFT's mini-batches; -1: the run's seed. With demo_seed, a run's demonstrations,
    # batch order and RL draws (its own seed) can each come from another seed (which one makes a seed weak)
    order_seed: int = -1
    # > 0: the prompt's tokens are SFT targets too, their token-mean NLL weighted this much against the
    # action's: a model trained from scratch learns the env's text, copying included, not only the answers
    prompt_weight: float = 0.0
    # the answer's tokens fitted as constrained decoding draws them, a softmax over the ids that continue an
    # admissible action (rollout.constrain_actions): SFT fits the policy the rollouts sample from
    constrain_actions: bool = False


@dataclass
class EvalCfg:
    every: int = 10  # RL steps between evaluations (0: only at the end)
    tasks: int = 32
    split: Literal["train", "valid", "test"] = "valid"
    samples: int = 1  # samples per task (pass@k needs k <= samples)
    temperature: float = 0.5
    # False: no evaluation before the first RL step (runs sharing one warm start need it read only once)
    at_start: bool = True


@dataclass
class TrainerCfg:
    steps: int = 20
    # >0: also stop once the training rollouts have taken this many env steps (the policy's actions, summed
    # over ranks), so recipes whose groups cost different numbers of steps compare at equal interaction
    env_steps: int = 0
    # >0: start no step that would end more than this many seconds after the trainer started (judged by
    # the longest step so far); the last step is still evaluated and checkpointed, so a job with a hard
    # wall-clock limit ends with a reading if this leaves time for one
    time_limit_s: float = 0.0
    seed: int = 0
    out_dir: str = "runs/{recipe}-{env}-s{seed}"
    checkpoint_every: int = 5
    keep_checkpoints: int = 2  # complete checkpoints kept; a resume falls back to the newest intact one
    # a non-finite loss or parameter: "stop" ends the run with one line naming the step; "skip" drops that
    # update (weights restored from before it) and counts it in the metrics
    nan_policy: Literal["stop", "skip"] = "stop"
    # > 0: rollouts for the next step run while the learner trains, with weights at most this many updates
    # old, and the loss corrects for the gap (docs: the asynchronous loop). 0: the on-policy loop
    max_staleness: int = 0
    ray_address: str = ""  # rollout.pool=ray: attach to this Ray cluster (or RAY_ADDRESS); empty: a local one
    engine: Literal["torch", "deepspeed"] = "torch"  # deepspeed: ZeRO-3, one rank or many under a launcher
    deepspeed_config: str = ""  # a DeepSpeed JSON (configs/deepspeed/); empty: ZeRO-3 in fp32
    device: str = "auto"  # auto (this rank's CUDA device when present, else CPU) | cpu | cuda
    # embedded: in the learner's process; remote: `agentrl serve`; vllm: `vllm serve` processes, started
    # here (vllm_servers of them) or attached to (generator_url: one URL or a list), synced in place
    generator: Literal["embedded", "remote", "vllm"] = "embedded"
    generator_url: str | list[str] = ""
    vllm_servers: int = 1
    vllm_port: int = 8100  # first port of the servers started here
    vllm_sync: Literal["auto", "shm", "nccl"] = "auto"  # auto: nccl on CUDA, shared memory on CPU
    check_sync: bool = True  # after each sync: server log-probs equal learner log-probs on a fixed sequence
    sync_atol: float = 0.1  # that check's tolerance on the mean |log-prob difference| (bf16 servers: ~0.01)
    tensorboard: bool = True
    wandb: bool = False
    progress: bool = True


@dataclass
class RecipeCfg:
    recipe: str = "grpo"
    method: str = ""  # the registered recipe class implementing it (default: the recipe's own name)
    env: str = "sokoban"
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    model: ModelCfg = field(default_factory=ModelCfg)
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    algo: AlgoCfg = field(default_factory=AlgoCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    sft: SFTCfg = field(default_factory=SFTCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    trainer: TrainerCfg = field(default_factory=TrainerCfg)
    extra: dict[str, Any] = field(default_factory=dict)  # recipe-specific knobs, validated by the recipe

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def out_dir(self) -> Path:
        return Path(self.trainer.out_dir.format(recipe=self.recipe, env=self.env, seed=self.trainer.seed))


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
    the node holding them). A long list written out is fine: only what aliases repeat counts."""

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
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


def load_yaml(text: str, what: str) -> Any:
    """``text`` parsed as YAML (safe types only, aliases bounded); one ConfigError line naming ``what`` otherwise."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506  (a SafeLoader subclass)
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what}: malformed YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"{what}: YAML nested too deeply") from None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the recipe YAML: {e}") from None
    data = load_yaml(text, str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe YAML must be a mapping, got {type(data).__name__}")
    return data


def recipe_yaml(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    cand = RECIPE_DIR / f"{name_or_path}.yaml"
    if not cand.exists():
        known = sorted(x.stem for x in RECIPE_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown recipe '{name_or_path}'; allowed: {', '.join(known)} (or a path to a .yaml)")
    return cand


def resolve_yaml(name_or_path: str, seen: tuple[str, ...] = (), env: str | None = None) -> dict[str, Any]:
    """The recipe's YAML with its ``base`` chain merged in (base first). With ``env``, each level's overlay
    for that env is applied right after that level's own keys, so a recipe's own setting beats an overlay
    it inherits (``leafe`` says ``trainer.steps: 1``; its base's alfworld overlay must not make that 10)."""
    path = recipe_yaml(name_or_path)
    if str(path) in seen:
        raise ConfigError(f"recipe inheritance loop: {' -> '.join(seen + (str(path),))}")
    from agentrl.recipe import RECIPES
    import agentrl.recipes  # noqa: F401  (registers the recipe classes)

    data = _read_yaml(path)
    own_method = data.get("method") or (path.stem if path.stem in RECIPES else None)
    base = data.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{path}: bad value for 'base': {base!r}; allowed: a recipe name (e.g. base: grpo) or a "
                          "path to a .yaml")
    overlay = None
    if env is not None:
        overlays = data.pop("env_overlays", None) or {}
        if not isinstance(overlays, dict):
            raise ConfigError(f"{path}: env_overlays must map env names to sections, got {type(overlays).__name__}")
        # an outside suite's envs ("gem:game:GuessTheNumber-v0") also take the suite's overlay ("gem")
        overlay = overlays.get(env, overlays.get(env.split(":")[0]) if ":" in env else None)
        if overlay is not None and not isinstance(overlay, dict):
            raise ConfigError(f"{path}: env_overlays.{env} must be a mapping of sections, got {type(overlay).__name__}")
    if base:
        data = deep_merge(resolve_yaml(base, seen + (str(path),), env), data)
    if overlay:
        data = deep_merge(data, overlay)
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
    chosen_env = env or resolve_yaml(recipe).get("env", RecipeCfg.env)
    data = resolve_yaml(recipe, env=chosen_env)
    name = data["recipe"]
    data["env"] = chosen_env
    if model:
        data.setdefault("model", {})["name"] = model
    parsed = [(text, *parse_override(text)) for text in overrides]
    data = _apply_model_overlay(data, parsed)
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


def _apply_model_overlay(data: dict[str, Any], parsed: list[tuple[str, list[str], Any]]) -> dict[str, Any]:
    """Merge ``model_overlays[<chosen model>]`` under the command line's overrides (which still win)."""
    overlays = data.pop("model_overlays", None) or {}
    if not isinstance(overlays, dict):
        raise ConfigError(f"model_overlays must map model names to sections, got {type(overlays).__name__}")
    name = (data.get("model") or {}).get("name", ModelCfg.name)
    for _, keys, value in parsed:
        if keys == ["model", "name"]:
            name = value
    overlay = overlays.get(name) if isinstance(name, str) else None  # a model folder's path gets none
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
    import agentrl.recipes  # noqa: F401  (registers the recipe classes)

    if cfg.method not in RECIPES:
        raise ConfigError(f"bad value for 'method': {cfg.method!r}; allowed: {', '.join(RECIPES.names())}")
    cls = RECIPES.get(cfg.method)
    params = getattr(cls, "Params", None)
    if params is None and cfg.extra:
        raise ConfigError(f"unknown key 'extra.{next(iter(cfg.extra))}': recipe method '{cfg.method}' "
                          "takes no extra keys")
    if params is not None:
        build(params, cfg.extra, "extra.")
    if cfg.algo.estimator not in ESTIMATORS:
        raise ConfigError(f"bad value for 'algo.estimator': {cfg.algo.estimator!r}; allowed: "
                          f"{', '.join(ESTIMATORS.names())}")
    if cfg.algo.loss not in LOSSES:
        raise ConfigError(f"bad value for 'algo.loss': {cfg.algo.loss!r}; allowed: {', '.join(LOSSES.names())}")
    est = ESTIMATORS.get(cfg.algo.estimator)
    if est.needs_values and not est.token_level and cfg.algo.level == "trajectory":
        raise ConfigError(f"'algo.estimator: {cfg.algo.estimator}' trains a critic on turns: it needs "
                          "'algo.level: turn' (for a critic over whole full-chat episodes use gae_token)")
    if est.token_level and (cfg.algo.level != "trajectory" or cfg.rollout.chat_mode != "full"):
        raise ConfigError(f"'algo.estimator: {cfg.algo.estimator}' is token-level GAE over whole multi-turn "
                          "episodes: it needs 'algo.level: trajectory' and 'rollout.chat_mode: full'")
    for f in cfg.algo.filters:
        if f not in FILTERS:
            raise ConfigError(f"bad value in 'algo.filters': {f!r}; allowed: {', '.join(FILTERS.names())}")
    if cfg.env not in registry.names() and ":" not in cfg.env:
        raise ConfigError(f"bad value for 'env': {cfg.env!r}; allowed: {', '.join(registry.names())}")
    if cfg.rollout.group_size < 1 or cfg.rollout.groups < 1:
        raise ConfigError("rollout.groups and rollout.group_size must be >= 1")
    if cfg.sft.workers < 0:
        raise ConfigError(f"bad value for 'sft.workers': {cfg.sft.workers}; allowed: 0 (one per core) or more")
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
    if s.cooldown < 0:
        raise ConfigError(f"bad value for 'sft.cooldown': {s.cooldown}; allowed: 0 (off) or more passes")
    for key in ("demo_seed", "order_seed"):
        if (v := getattr(s, key)) < -1:
            raise ConfigError(f"bad value for 'sft.{key}': {v}; allowed: -1 (the run's seed) or a seed >= 0")
    if s.constrain_actions and not cfg.rollout.constrain_actions:
        raise ConfigError("sft.constrain_actions fits the policy that constrained decoding samples from; set "
                          "rollout.constrain_actions=true too, or sft.constrain_actions=false for free decoding")
    if not s.prompt_weight >= 0.0:
        raise ConfigError(f"bad value for 'sft.prompt_weight': {s.prompt_weight}; allowed: 0 (off) or a weight > 0")
    if not s.select_every > 0:
        raise ConfigError(f"bad value for 'sft.select_every': {s.select_every}; allowed: > 0 (passes between readings)")
    if not 0.0 <= s.target_success <= 1.0:
        raise ConfigError(f"bad value for 'sft.target_success': {s.target_success}; allowed: 0 (off) to 1")
    if s.max_epochs > s.epochs:
        if s.select_split == cfg.eval.split:
            raise ConfigError(f"sft.select_split={s.select_split} is also eval.split: choosing the warm start's "
                              "passes on the evaluation tasks would leak them; pick another split")
        if s.schedule != "constant":
            raise ConfigError(f"sft.max_epochs={s.max_epochs} with sft.schedule={s.schedule}: a decaying lr "
                              "needs a known number of passes; use sft.schedule=constant or drop sft.max_epochs")
    a = cfg.algo
    if a.progress_coef < 0 or (a.progress_coef and a.reward == "env_return"):
        raise ConfigError(f"bad value for 'algo.progress_coef': {a.progress_coef}; allowed: >= 0, added to "
                          "algo.reward=success or score (env_return takes the env's own step rewards)")
    r = cfg.rollout
    if r.task_sampler not in TASK_SAMPLERS:
        raise ConfigError(f"bad value for 'rollout.task_sampler': {r.task_sampler!r}; allowed: "
                          f"{', '.join(TASK_SAMPLERS.names())}")
    if not 0.0 <= r.frontier_share <= 1.0 or r.frontier_size < 1:
        raise ConfigError(f"bad value for 'rollout.frontier_share' ({r.frontier_share}) or 'rollout.frontier_size' "
                          f"({r.frontier_size}); allowed: a share from 0 to 1, a size >= 1")
    if cfg.rollout.max_rounds < 1 or cfg.rollout.fill_groups < 0:
        raise ConfigError(f"bad value for 'rollout.max_rounds' ({cfg.rollout.max_rounds}) or 'rollout.fill_groups' "
                          f"({cfg.rollout.fill_groups}); allowed: max_rounds >= 1, fill_groups >= 0")
    _check_ranges(cfg)
    _check_contradictions(cfg)


def _check_ranges(cfg: RecipeCfg) -> None:
    """Values their types admit but no run can use (a negative temperature, a zero lr): one line naming the key."""
    r, a, o, s, e, t = cfg.rollout, cfg.algo, cfg.optim, cfg.sft, cfg.eval, cfg.trainer
    rules: list[tuple[str, Any, bool, str]] = [
        ("rollout.temperature", r.temperature, r.temperature >= 0, ">= 0 (0: greedy)"),
        ("eval.temperature", e.temperature, e.temperature >= 0, ">= 0 (0: greedy)"),
        ("rollout.top_p", r.top_p, 0 < r.top_p <= 1, "above 0, at most 1"),
        ("optim.lr", o.lr, o.lr > 0, "> 0"),
        ("optim.critic_lr", o.critic_lr, o.critic_lr >= 0, ">= 0 (0: optim.lr)"),
        ("sft.lr", s.lr, s.lr > 0, "> 0"),
        ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0"),
        ("optim.grad_clip", o.grad_clip, o.grad_clip is None or o.grad_clip > 0, "> 0, or null for no clipping"),
        ("optim.token_budget", o.token_budget, o.token_budget >= 1, ">= 1"),
        ("algo.eps_low", a.eps_low, a.eps_low >= 0, ">= 0"),
        ("algo.eps_high", a.eps_high, a.eps_high >= 0, ">= 0"),
        ("algo.gamma", a.gamma, 0 <= a.gamma <= 1, "0 to 1"),
        ("algo.lam", a.lam, 0 <= a.lam <= 1, "0 to 1"),
        ("algo.kl_coef", a.kl_coef, a.kl_coef >= 0, ">= 0"),
        ("algo.kl_reward_coef", a.kl_reward_coef, a.kl_reward_coef >= 0, ">= 0"),
        ("algo.variance_keep", a.variance_keep, 0 < a.variance_keep <= 1, "above 0, at most 1"),
        ("algo.ppo_epochs", a.ppo_epochs, a.ppo_epochs >= 1, ">= 1"),
        ("algo.mini_batches", a.mini_batches, a.mini_batches >= 1, ">= 1"),
        ("algo.mini_batch_samples", a.mini_batch_samples, a.mini_batch_samples >= 0, ">= 0 (0: algo.mini_batches)"),
        ("rollout.max_turns", r.max_turns, r.max_turns >= 1, ">= 1"),
        ("rollout.max_new_tokens", r.max_new_tokens, r.max_new_tokens >= 1, ">= 1"),
        ("rollout.slots", r.slots, r.slots >= 1, ">= 1"),
        ("sft.batch_size", s.batch_size, s.batch_size >= 1, ">= 1"),
        ("eval.tasks", e.tasks, e.tasks >= 0, ">= 0 (0: no evaluation)"),
        ("eval.samples", e.samples, e.samples >= 1, ">= 1 (pass@k reads k <= samples)"),
        ("eval.every", e.every, e.every >= 0, ">= 0 (0: only at the end)"),
        ("trainer.steps", t.steps, t.steps >= 0, ">= 0"),
        ("trainer.checkpoint_every", t.checkpoint_every, t.checkpoint_every >= 1, ">= 1"),
        ("trainer.time_limit_s", t.time_limit_s, t.time_limit_s >= 0, ">= 0 (0: no limit)"),
    ]
    for key, value, ok, allowed in rules:
        if not ok:
            raise ConfigError(f"bad value for '{key}': {value!r}; allowed: {allowed}")


# estimators whose advantage is relative to the rest of the episode's group: zero (or undefined) in a group of one
GROUP_RELATIVE = ("grpo", "dr_grpo", "rloo", "gigpo", "gigpo_dr", "reinforce_pp_baseline")


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


def warm_start_folder(cfg: RecipeCfg) -> Path | None:
    """Where ``sft.warm_start``'s weights are read: the folder given, else (a resumed run whose source is
    gone) the run's own copy; None when neither holds a model."""
    src, run = Path(cfg.sft.warm_start).expanduser(), cfg.out_dir
    if (src / "config.json").is_file():
        return src
    if (run / "checkpoint").exists() and (run / "warm_start" / "config.json").is_file():
        return run / "warm_start"
    return None


def dump(cfg: RecipeCfg, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
