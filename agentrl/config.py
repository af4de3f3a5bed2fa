"""The recipe configuration schema: typed dataclasses, one per section, every key with its default and meaning.

Below the recipes and the trainer: every layer may import it. Reading recipe YAMLs, overlays and overrides into a
checked ``RecipeCfg`` sits above the recipes, in ``agentrl.config_loader`` (``agentrl.load_config``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from agentrl.schema import ConfigError  # noqa: F401  (re-exported for callers)


@dataclass
class ModelCfg:
    name: str = "tiny"  # tiny | tiny:KEY=N,... (sized) | smollm2 | path to an HF folder
    dtype: str = "float32"  # the learner's parameter dtype (float32, bfloat16)
    lora_r: int = 0  # > 0 turns LoRA on
    lora_alpha: int = 16  # LoRA's scaling alpha (with model.lora_r > 0)
    # "bf16": the torch engine trains under bf16 autocast (fp32 weights and rollouts; ~2x faster updates
    # on CPUs with AVX512-BF16 or AMX; on CPUs without bf16 instructions, where it is several times slower,
    # the run trains in fp32 and says so). "": plain dtype
    autocast: Literal["", "bf16"] = ""
    # torch.compile the learner's decoder (dynamic shapes): a small model's step on a GPU is bound by the
    # operators it dispatches, which compiling fuses (docs/studies/gpu.md); the first step pays the compile
    compile: bool = False
    # activation checkpointing (non-reentrant) on the learner's decoder layers and the critic's: the backward
    # pass recomputes each layer's activations instead of keeping them, for long rows (docs/guides/memory.md)
    gradient_checkpointing: bool = False
    # the dtype of the HF folder each checkpoint writes (step-N/model): "auto" is bfloat16 under
    # trainer.engine=deepspeed (a 7B export is 15 GB, not 30) and model.dtype under the torch engine. Resume
    # reads the engine's own state, never this folder, so nothing is lost; SFT's warm start stays exact
    export_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"


@dataclass
class RolloutCfg:
    groups: int = 4  # distinct start states per step
    group_size: int = 4  # rollouts per start state (G)
    slots: int = 16  # env slots rolled out together
    refill: bool = False  # a slot takes the next start when its episode ends (no waves; same episodes, fewer calls)
    # "async": each episode advances on its own, no per-turn barrier (same episodes; docs/guides/async.md);
    # "continuous": env slots never wait for a step, which takes the first complete groups (trainer.max_staleness)
    mode: Literal["lockstep", "async", "continuous"] = "lockstep"
    # where env slots run: in the trainer's process, one worker process per env (restarted and replayed when it dies),
    # or Ray actors (trainer.ray_address)
    pool: Literal["inprocess", "process", "ray"] = "inprocess"
    ray_slots_per_actor: int = 1  # pool=ray: env slots per Ray actor (one worker process; docs/guides/ray.md)
    ray_num_cpus: float = 1.0  # pool=ray: CPUs each actor reserves on its node (Ray's scheduler places it)
    ray_memory_mb: int = 0  # pool=ray: memory each actor reserves, MiB (0: none declared)
    # pool=ray: custom resources each actor needs, e.g. {env_node: 1} pins env workers to nodes offering them
    ray_resources: dict[str, float] = field(default_factory=dict)
    max_turns: int = 8  # turns an episode may take before it is truncated
    history_len: int = 2  # window mode: past turns shown in each prompt
    # window: a fresh prompt per turn with the last history_len turns; full: the whole episode as one growing chat
    # (RAGEN/StarPO)
    chat_mode: Literal["window", "full"] = "window"
    temperature: float = 1.0  # sampling temperature of training rollouts
    top_p: float = 1.0  # nucleus sampling threshold of training rollouts
    max_new_tokens: int = 48  # tokens one response may generate
    # a prompt that with max_new_tokens would not fit the model's context (never sent to a generator): "trim"
    # rebuilds it with fewer history turns, then a shorter observation, else ends the episode as truncated;
    # "truncate" ends the episode; "error" stops the run naming the env, task, turn and lengths
    context_overflow: Literal["trim", "truncate", "error"] = "trim"
    require_think: bool = False  # a response needs <think>...</think> before its answer, else it gets format_penalty
    format_penalty: float = -0.1  # reward added to a turn without a valid answer
    max_actions_per_turn: int = 0  # actions one response may take (0: the env's own; Sokoban's parser takes 5)
    max_episode_actions: int = 0  # actions an episode may take in all, then it is truncated (0: no cap)
    # per turn whose actions changed nothing (same env fingerprint before and after); a shaping term
    ineffective_penalty: float = 0.0
    show_admissible: bool = True  # list the env's admissible actions in the prompt
    # decode only answers among the env's admissible actions (a trie over their tokens masks every other
    # token); the learner renormalizes over the same tokens. Every generator: ours in-process or served,
    # vLLM through our logits processor
    constrain_actions: bool = False
    # "compact": the react template's task, history, observation and admissible actions without its
    # boilerplate sentences (ALFWorld: ~40% fewer prompt tokens, so SFT and RL steps cost that much less);
    # "compact_tried": compact, with the actions tried so far on their own line and left out of "Actions:";
    # "numbered": every admissible action numbered (untried first), the policy answers with a number
    prompt: Literal["paper", "compact", "compact_tried", "numbered"] = "paper"
    split: Literal["train", "valid", "test"] = "train"  # the task split training rollouts draw from
    # DAPO's dynamic sampling: after a round of ``groups`` starts, roll out more rounds until this many
    # groups have reward variance (the ones with a group-relative gradient), at most ``max_rounds`` rounds
    # in all. 0: one round.
    fill_groups: int = 0
    max_rounds: int = 3  # dynamic sampling: the most rollout rounds in one step
    # which tasks fresh groups start from: "uniform" (at random from the split) or "learnability" (a share
    # of each round replays levels whose last group had reward variance; agentrl/curriculum/task_sampler.py)
    task_sampler: str = "uniform"
    frontier_share: float = 0.5  # learnability: the share of a round's groups drawn from the frontier
    frontier_size: int = 256  # learnability: the most levels kept in the frontier (the oldest leave first)


@dataclass
class AlgoCfg:
    # the advantage estimator, from agentrl.algos.advantages.ESTIMATORS: grpo | dr_grpo | rloo | reinforce_pp |
    # reinforce_pp_baseline | gae | gae_token | gigpo | gigpo_dr
    estimator: str = "grpo"
    level: Literal["turn", "trajectory"] = "turn"  # window-mode turns, or whole full-chat episodes
    # turn level: "episode" divides each turn's advantage by its episode's number of turns, so every
    # trajectory weighs the same; "uniform" lets long (often failed) episodes outweigh short ones
    turn_weight: Literal["uniform", "episode"] = "uniform"
    # what an episode is rewarded with: success (1 when won), score (the env's 0-1 score) or env_return (the env's own
    # step rewards)
    reward: Literal["score", "success", "env_return"] = "success"
    # success/score plus coef x the env's progress at the episode's end (Sokoban: the share of the
    # box-to-target distance closed), so that a group whose every episode fails still ranks them
    progress_coef: float = 0.0
    gamma: float = 1.0  # discount over turns (GAE)
    lam: float = 1.0  # GAE's lambda
    whiten: bool = False  # advantages normalized to mean 0, std 1 over the batch (verl's PPO does this to GAE)
    gigpo_step_weight: float = 1.0  # GiGPO: the weight of the step-level advantage added to the episode-level one
    # the policy surrogate, from agentrl.algos.losses.LOSSES: ppo | gspo (set eps_low/high to ~3e-4/4e-4) |
    # cispo | kl_cov
    loss: str = "ppo"
    eps_low: float = 0.2  # PPO clip range below 1 (the ratio's lower bound is 1 - eps_low)
    eps_high: float = 0.2  # PPO clip range above 1; above eps_low it is clip-higher (DAPO)
    dual_clip: float | None = None  # dual-clip bound C on negative advantages (null: off)
    # how token losses are aggregated into the loss
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    kl: Literal["k1", "k2", "k3", "none"] = "none"  # a KL term in the loss (kl_coef x the estimator)
    kl_coef: float = 0.0  # weight of the KL loss term (algo.kl)
    # KL as a reward penalty: an episode's reward minus coef x its k1 KL to the reference policy
    kl_reward_coef: float = 0.0
    kl_reward_target: float | None = None  # adaptive coefficient steering the KL per episode toward this
    kl_reward_horizon: int = 10_000  # the adaptive controller's horizon, in episodes
    entropy_coef: float = 0.0  # weight of the entropy bonus
    # Clip-Cov: the fraction of tokens of highest covariance left out of the gradient (0: off)
    clip_cov_ratio: float = 0.0
    kl_cov_ratio: float = 2e-3  # loss kl_cov: the fraction of tokens penalized
    kl_cov_coef: float = 1.0  # loss kl_cov: the weight of |log r| on them
    ppo_epochs: int = 1  # passes over each step's batch
    # optimizer steps per epoch: the batch is shuffled and split into this many mini-batches (verl's
    # ppo_mini_batch_size). One full-batch step per RL step left the tiny model all but unmoved in 15 steps.
    mini_batches: int = 1
    # > 0: mini-batches of about this many samples instead (ceil(samples / this) of them), so a step left
    # with few informative samples after the filters takes fewer optimizer steps, not as many on less data
    mini_batch_samples: int = 0
    # the PPO ratio's old log-probs: "sampler" (what the generator recorded with each token), "learner" (one
    # no-grad pass over the batch before the update, as verl recomputes them), "auto": learner under
    # rollout.mode=async, whose generator batches rows as they arrive, which moves their log-probs in the last
    # digits, so that a seeded async run repeats exactly; sampler otherwise. Stale samples are decoupled anyway
    old_logprobs: Literal["auto", "sampler", "learner"] = "auto"
    # the sampler/learner mismatch (the same weights give other log-probs in vLLM's kernels or dtype), corrected
    # on every step from one learner pass: "tis" weights each token's advantage by min(pi_learner / pi_sampler,
    # mismatch_cap); "mis" masks each sample whose geometric-mean ratio leaves [1/cap, cap] and weights the
    # rest by it; "none"; "auto": tis with trainer.generator=vllm, none otherwise (exactly the learner's
    # log-probs). Stale samples (trainer.max_staleness) are corrected either way (tis unless mis)
    mismatch: Literal["auto", "none", "tis", "mis"] = "auto"
    mismatch_cap: float = 2.0  # algo.mismatch's bound C (> 1): tis truncates at C, mis keeps ratios in [1/C, C]
    value_coef: float = 0.5  # weight of the value loss (estimators with a critic)
    value_clip: float | None = 0.2  # clip range of the value loss (null: unclipped)
    # the critic of value-based estimators (gae, gae_token): "separate", a network of its own (its own
    # optimizer and lr, as verl and OpenRLHF); "shared", a value head on the policy (the value loss trains it too)
    critic: Literal["separate", "shared"] = "separate"
    # algo.critic=separate: an HF model folder whose transformer starts the critic; empty: the policy's weights
    critic_path: str = ""
    # group and episode filters applied before the estimator, from agentrl.algos.filters.FILTERS: dropped |
    # zero_variance | variance | overlong | void_turn | invalid_format
    filters: list[str] = field(default_factory=lambda: ["dropped"])
    variance_keep: float = 1.0  # fraction of groups kept by the variance filter (when listed)
    # what the variance filters and dynamic sampling test for variance: the reward as trained on, or the
    # episode's outcome alone (success or score, without penalties or progress). With per-turn shaping
    # nearly every group's rewards differ, so "reward" keeps every group and dynamic sampling stops at once
    filter_on: Literal["reward", "outcome"] = "reward"

    @property
    def kl_in_loss(self) -> bool:
        """The loss has a KL term (an estimator in algo.kl and a positive algo.kl_coef)."""
        return self.kl != "none" and self.kl_coef > 0

    @property
    def needs_reference(self) -> bool:
        """The run loads a frozen KL reference policy: the loss's KL term or the KL reward penalty reads it."""
        return self.kl_in_loss or self.kl_reward_coef > 0


@dataclass
class OptimCfg:
    lr: float = 1e-4  # the RL learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW's weight decay
    grad_clip: float | None = 1.0  # gradient norm clip (null: none)
    warmup_steps: int = 0  # optimizer steps of linear lr warm-up
    # lr over the RL steps: "linear"/"cosine" decay it to 0 by trainer.steps (set once per RL step, so a
    # resumed run picks it up where it was)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    token_budget: int = 16384  # padded tokens per micro-batch on each rank (packing: real tokens of rows run packed)
    # generated positions projected to the vocabulary at a time, forward and backward (recomputed): at most
    # one chunk's full-vocabulary logits exist at once; 0: all of a micro-batch's at once
    logits_chunk: int = 0
    # micro-batches of rows concatenated into one row up to token_budget real tokens, each row's positions
    # restarting at 0 and its attention limited to itself: no padding computed (a micro-batch whose rows
    # share a long prompt prefix runs padded with the prefix once when that computes fewer positions; a model
    # whose packed rows would need a dense mask, eager or sliding-window attention, runs padded)
    packing: bool = True
    # algo.critic=separate: the critic's learning rate, constant (0: optim.lr); RAGEN's critic runs at 10x the actor's
    critic_lr: float = 0.0


@dataclass
class SFTCfg:
    enabled: bool = False  # warm start on expert demonstrations before RL
    demos: int = 64  # expert episodes (train split)
    epochs: int = 2  # SFT passes over the demonstrations
    batch_size: int = 16  # turns per SFT batch (a full-chat demonstration is one row of its turns)
    lr: float = 1e-3  # the SFT learning rate
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
    select_split: Literal["train", "valid", "test"] = "test"  # the split SFT's pass selection reads (never eval.split)
    select_tasks: int = 200  # tasks read after each pass by the pass selection
    select_patience: int = 2  # readings in a row without a new best before stopping (200 tasks read +-3 points)
    # passes between selection readings after pass `epochs` (0.25: every quarter pass, so SFT can stop
    # mid-pass; on Sokoban a quarter pass still moved success by up to 13 points: docs/studies/make_train_seeds.md)
    select_every: float = 1.0
    # the warm start: the pass with the best selection reading (kept when reached), or the last pass made
    select_keep: Literal["best", "last"] = "best"
    # > 0: stop by competence instead of plateau: passes after `epochs` go on (up to max_epochs; none when
    # max_epochs <= epochs) only while the selection reading is below this, and the warm start is the last
    # pass made. On a steep SFT curve a fixed pass count leaves a lagging seed far below the others
    # (docs/studies/make_train_seeds.md)
    target_success: float = 0.0
    # RL starts with a fresh optimizer state: Adam's second moments carried over from SFT, whose gradients
    # are several times RL's, shrink RL's updates ~4x for hundreds of steps (docs/studies/make_train_seeds.md)
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
    tasks: int = 32  # tasks per evaluation
    split: Literal["train", "valid", "test"] = "valid"  # the split evaluations read
    samples: int = 1  # samples per task (pass@k needs k <= samples)
    temperature: float = 0.5  # sampling temperature of evaluations (0: greedy)
    # False: no evaluation before the first RL step (runs sharing one warm start need it read only once)
    at_start: bool = True


@dataclass
class TrainerCfg:
    steps: int = 20  # RL steps of the run
    # >0: also stop once the training rollouts have taken this many env steps (the policy's actions, summed
    # over ranks), so recipes whose groups cost different numbers of steps compare at equal interaction
    env_steps: int = 0
    # >0: start no step that would end more than this many seconds after the trainer started (judged by
    # the longest step so far); the last step is still evaluated and checkpointed, so a job with a hard
    # wall-clock limit ends with a reading if this leaves time for one
    time_limit_s: float = 0.0
    seed: int = 0  # the run's seed (`--seed`)
    out_dir: str = "runs/{recipe}-{env}-s{seed}"  # the run folder; {recipe}, {env} and {seed} are filled in
    checkpoint_every: int = 5  # RL steps between checkpoints
    keep_checkpoints: int = 2  # complete checkpoints kept; a resume falls back to the newest intact one
    # a non-finite loss or parameter: "stop" ends the run with one line naming the step; "skip" drops that
    # update (weights restored from before it) and counts it in the metrics
    nan_policy: Literal["stop", "skip"] = "stop"
    # N > 0: the next N steps' rollouts are collected while the learner trains, step t's with the weights
    # after t - N updates (the loss corrects the gap; any recipe that rolls out, any number of ranks; N > 1
    # with the embedded generator or vLLM's shared-memory sync, N or N + 1 host copies of the weights; docs:
    # the asynchronous loop). 0: on-policy
    max_staleness: int = 0
    # with max_staleness > 0: each update's weights load into the generator mid-collect (the embedded one at its
    # next forward pass; vLLM servers at once, shm sync: running requests aborted and continued) and every token
    # records the version that drew it (docs: the asynchronous loop)
    inflight_updates: bool = False
    ray_address: str = ""  # rollout.pool=ray: attach to this Ray cluster (or RAY_ADDRESS); empty: a local one
    engine: Literal["torch", "deepspeed"] = "torch"  # deepspeed: ZeRO-3, one rank or many under a launcher
    deepspeed_config: str = ""  # a DeepSpeed JSON (configs/deepspeed/); empty: ZeRO-3 in fp32
    device: str = "auto"  # auto (this rank's CUDA device when present, else CPU) | cpu | cuda
    # embedded: in the learner's process; remote: `agentrl serve`; vllm: `vllm serve` processes, started
    # here (vllm_servers of them) or attached to (generator_url: one URL or a list), synced in place; or a
    # user's backend, package.module:make (agentrl.generation.backends)
    generator: str = "embedded"
    # trainer.generator remote or vllm: the server URL, or a list of URLs, to attach to
    generator_url: str | list[str] = ""
    vllm_servers: int = 1  # trainer.generator=vllm: the vllm serve processes rank 0 starts
    vllm_port: int = 8100  # first port of the servers started here
    # the GPUs of the servers started here, one entry per server (its CUDA_VISIBLE_DEVICES, e.g. [6, 7]);
    # empty: they inherit rank 0's devices and share the learner's GPU
    vllm_gpus: list[str] = field(default_factory=list)
    vllm_sync: Literal["auto", "shm", "nccl"] = "auto"  # auto: nccl on CUDA, shared memory on CPU
    check_sync: bool = True  # after each sync: server log-probs equal learner log-probs on a fixed sequence
    sync_atol: float = 0.1  # that check's tolerance on the mean |log-prob difference| (bf16 servers: ~0.01)
    tensorboard: bool = True  # write TensorBoard event files under RUN/tb
    wandb: bool = False  # log to wandb (with the wandb_* keys below) and the rollout records' sample as a Table
    wandb_project: str = "agentrl"  # trainer.wandb: the wandb project
    wandb_entity: str = ""  # trainer.wandb: the wandb entity (team or user; empty: wandb's default)
    wandb_name: str = ""  # trainer.wandb: the wandb run's name (empty: the run folder's name)
    # trainer.wandb: offline (files under RUN/wandb, `wandb sync` later), online, or disabled; $WANDB_MODE wins
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    # rollout records under RUN/rollouts (`agentrl view`, `agentrl show`, agentrl.runs): the groups recorded
    # per step, the first ones of the step (0: every group; -1: no records)
    record_groups: int = 8
    record_every: int = 1  # RL steps between recorded steps
    record_eval_tasks: int = 64  # the tasks of each evaluation recorded, the first ones (0: every task; -1: none)
    record_tokens: bool = True  # each generated token's text, log-prob and version (token colouring in the viewer)
    progress: bool = True  # print a progress line per step


@dataclass
class VLLMCfg:
    """The vLLM servers' own options, under vLLM's names: for the servers the trainer starts
    (trainer.vllm_servers) and in the command agentrl.generation.vllm.vllm_command prints for servers
    started by hand. --max-lora-rank follows model.lora_r."""
    tensor_parallel_size: int = 1  # GPUs per server (vLLM's --tensor-parallel-size)
    # the share of its GPU's memory a server reserves for weights and KV cache (vLLM's
    # --gpu-memory-utilization); 0: vLLM's own default on a GPU of its own (0.92), 0.3 of RAM on CPU
    gpu_memory_utilization: float = 0.0
    max_model_len: int = 0  # longest context a server holds (prompt + response); 0: the model's own
    max_num_seqs: int = 0  # sequences a server runs at once; 0: vLLM's default
    enable_prefix_caching: bool = True  # a group's G rollouts share their prompt's KV cache
    # the address the servers bind: 127.0.0.1 (one node), 0.0.0.0 (every interface: ranks on other nodes)
    host: str = "127.0.0.1"
    # the address the ranks reach the servers by; empty: `host`, or this node's own address when host
    # binds every interface
    advertise_host: str = ""
    extra_args: list[str] = field(default_factory=list)  # more `vllm serve` flags, passed as they are
    # the servers share the learner's GPUs (trainer.vllm_gpus may name them): weights go over CUDA IPC, and
    # the servers sleep (KV cache and weights freed) while the learner trains; gpu_memory_utilization is
    # then the share the server takes (e.g. 0.3), the rest is the learner's
    colocate: bool = False
    nccl_port: int = 29700  # NCCL weight transfer: the rendezvous port on rank 0's node
    # NCCL weight transfer: the rendezvous address (empty: 127.0.0.1 when every rank and server is on one
    # node, else the launcher's MASTER_ADDR, else this node's address)
    nccl_address: str = ""
    sync_timeout_s: float = 300.0  # one weight sync to one server; past it the server counts as dead


@dataclass
class RecipeCfg:
    recipe: str = "grpo"  # the recipe's name: a YAML in recipes/ (set from the file the run loads; not set by hand)
    method: str = ""  # the registered recipe class implementing it (default: the recipe's own name)
    # the env: a registered name (`agentrl envs list`), `module:Class`, `gymnasium:<id>`, `gem:<id>`, `textarena:<id>`
    # or `rg:<dataset>`
    env: str = "sokoban"
    # keyword arguments for the env's constructor (e.g. `data_dir`, `gym_kwargs`, `expert`)
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    model: ModelCfg = field(default_factory=ModelCfg)
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    algo: AlgoCfg = field(default_factory=AlgoCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    sft: SFTCfg = field(default_factory=SFTCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    trainer: TrainerCfg = field(default_factory=TrainerCfg)
    vllm: VLLMCfg = field(default_factory=VLLMCfg)  # the vLLM servers' options (trainer.generator=vllm)
    extra: dict[str, Any] = field(default_factory=dict)  # recipe-specific knobs, validated by the recipe

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def out_dir(self) -> Path:
        return Path(self.trainer.out_dir.format(recipe=self.recipe, env=self.env, seed=self.trainer.seed))


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
    from agentrl.io_atomic import open_in_folder  # a link at config.yaml leaving the folder is refused

    with open_in_folder(path, "w") as f:
        f.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
