"""The actor/learner loop: env slots -> rollouts -> batches -> learner -> weights -> generator.

The trainer owns the parts (learner engine, generator, env slots, rollout engine, metric sinks,
checkpoints); the recipe decides what one step does (``Recipe.step``). Runs resume from their last
checkpoint with the learner, the recipe's buffers and controllers, the task sampler and every RNG.

Under a launcher with N ranks every rank runs the same loop and the same recipe code on the same
RNG: ``rollout`` and ``generate`` roll out this rank's share (whole groups) and all-gather the results,
so every decision a recipe takes (filters, dynamic-sampling rounds, buffers, controllers, skipping an
update) is taken on the global episodes, identically on every rank, and every rank reaches the same
collectives. The engine then trains each rank on its rows. Rank 0 alone prints, logs and writes the
trainer's and recipe's state; checkpoints are collective.

With ``trainer.max_staleness: 1`` the next step's ``collect`` runs in a producer thread while this step
learns (on every rank, its gathers on a process group of their own), and the loss corrects for samples one
update old (``_overlapped_step``, ``agentrl.rollout.overlap``, docs/guides/async.md).
"""
from __future__ import annotations

import json
import logging
import math
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from agentrl import checkpoint as ckpt
from agentrl import dist
from agentrl.checkpoint import RunError
from agentrl.config import ConfigError, RecipeCfg, dump, warm_start_folder
from agentrl.io_atomic import atomic_write_text
from agentrl.learner.batch import Sample, collate
from agentrl.learner.engine import EngineConfig, LoraSettings, OptimConfig, TorchEngine
from agentrl.learner.finite import StepGuard, params_finite
from agentrl.learner.lr import lr_factor, set_lr
from agentrl.metrics import (MetricsLogger, echo_trap_flags, episode_diagnostics, pass_at_k, peak_rss_gib, read_metrics,
                             truncate_metrics)
from agentrl.rollout.engine import RolloutConfig, RolloutEngine, Start
from agentrl.rollout.overlap import Producer
from agentrl.seeds import mix_seed
from agentrl.types import Completion, Episode, SamplingParams

if TYPE_CHECKING:
    from agentrl.generation.base import Generator
    from agentrl.learner.protocol import LearnerEngine, LossFn
    from agentrl.recipe import Recipe
    from agentrl.envs.slots import EnvSlots

CHECKPOINT_LINK = ckpt.LINK  # RUN/checkpoint -> checkpoints/step-NNNNNN, switched once a save is complete
__all__ = ["RunError", "Trainer", "check_run_folder"]  # RunError lives in agentrl.checkpoint; the CLI imports it here


# what may change when a run resumes (how long it trains, how it is evaluated and logged, where servers
# are); any other difference from the config its checkpoint was written with makes it another run
RESUMABLE = ("trainer.steps", "trainer.env_steps", "trainer.progress", "trainer.tensorboard", "trainer.wandb",
             "trainer.checkpoint_every", "trainer.time_limit_s", "trainer.out_dir", "trainer.generator_url", "eval.")


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and k != "env_kwargs" and k != "extra":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_run_folder(out_dir: Path, cfg: RecipeCfg) -> None:
    """Refuse to resume a checkpoint written with another config (anything but ``RESUMABLE`` keys)."""
    saved = _saved_config(out_dir)
    if not saved:  # no checkpoint, or one from before configs were stored in it
        return
    was, now = _flat(saved), _flat(cfg.to_dict())
    # keys only one side has come from a code change (a new option at its default), not from the user
    diff = [f"{k}: {was[k]!r} there, {now[k]!r} here" for k in sorted(set(was) & set(now))
            if was[k] != now[k] and not k.startswith(RESUMABLE)]
    if diff:
        shown = "; ".join(diff[:6]) + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "")
        raise ConfigError(f"{out_dir} holds a checkpoint of another run ({shown}): resuming it would mix the two. "
                          "Start a new run with another trainer.out_dir (--out), or delete that folder; only the "
                          "budgets (trainer.steps, trainer.env_steps, trainer.time_limit_s), evaluation and "
                          "logging settings may change on resume")


def _saved_config(out_dir: Path) -> dict | None:
    """The config of the checkpoint a resume would start from: the link's, else the newest complete one's.
    Unreadable ones are passed over here; the resume itself verifies and says why."""
    target, _ = ckpt.link_target(out_dir)
    for folder in ([target] if target is not None else []) + ckpt.sealed_checkpoints(out_dir / "checkpoints"):
        if (folder / "trainer.pt").is_file():
            try:
                state = ckpt.load_plain(folder / "trainer.pt")
            except ckpt.CheckpointCorrupt:
                continue
            return state.get("config") if isinstance(state, dict) else None
    return None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """One run: ``Trainer.from_config(cfg)``, then ``train()`` (and ``evaluate()``), then ``close()``."""

    @classmethod
    def from_config(cls, cfg: RecipeCfg) -> "Trainer":
        """The trainer of ``cfg`` (``agentrl.load_config``) with its recipe, the class ``cfg.method`` names in
        ``RECIPES``. Builds the model, generator and env slots; ``close()`` releases them."""
        from agentrl.preflight import preflight
        from agentrl.recipe import RECIPES

        preflight(cfg)  # this machine can run cfg (device, packages, env, model folder): one line, before any work
        return cls(cfg, RECIPES.get(cfg.method or cfg.recipe)(cfg))

    def __init__(self, cfg: RecipeCfg, recipe: "Recipe"):
        from agentrl.learner.models import cap_kernel_caches
        from agentrl.model_zoo import resolve_model

        cap_kernel_caches()  # before any matmul of this process (docs/guides/memory.md)

        self._t0 = time.monotonic()  # trainer.time_limit_s counts from here: loading and the warm start included
        self.cfg, self.recipe = cfg, recipe
        self.out_dir = cfg.out_dir
        self.device = self._resolve_device()
        self._check_launch()  # before any collective or model loading: one clear error on every rank
        self.world = dist.init(self.device)
        self.rank = dist.rank()
        self.is_main = self.rank == 0
        # a bad model spec fails before the run folder is touched; sft.warm_start's weights replace model.name's
        self.model_dir = resolve_model(str(warm_start_folder(cfg)) if cfg.sft.warm_start else cfg.model.name)
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.run_id = self._claim_run_folder()  # a folder that is not this run's is refused before any write
            check_run_folder(self.out_dir, cfg)  # before config.yaml is rewritten: another run's folder is refused
            # and a folder with no intact checkpoint: its error says nothing was changed, so nothing may be yet
            self._verdicts: dict[Path, str | None] | None = self._verify_checkpoints()
            if self.is_main:
                dump(cfg, self.out_dir / "config.yaml")
        except OSError as e:
            raise RunError(f"cannot write the run folder {self.out_dir}: {e.strerror or e}; choose another "
                           "trainer.out_dir (--out)") from None
        seed_everything(cfg.trainer.seed)
        self.rng = random.Random(cfg.trainer.seed)  # the same stream on every rank: same decisions
        self.step = 0
        self.env_steps = 0  # the training rollouts' env steps so far (``trainer.env_steps`` budgets them)
        self._time_up, self._longest_step = False, 0.0  # trainer.time_limit_s
        self.engine: LearnerEngine = self._make_engine()
        self._step_guard = StepGuard(self.engine)  # an optimizer step with a NaN or infinite gradient is not applied
        self.tokenizer = self.engine.tokenizer
        # trainer.max_staleness > 0: the next step's collect runs in a producer thread while this step learns
        # (under several ranks its gathers go to a group of their own, apart from the engine's collectives)
        self._producer = Producer(dist.side_group()) if cfg.trainer.max_staleness > 0 else None
        self._sync_due, self._stale = False, False
        self.generator: Generator = self._make_generator()
        self.envs: EnvSlots = self._make_envs()
        self._pool_seen: dict[str, int] = dict(self.envs.stats)
        self.logger = MetricsLogger(self.out_dir, cfg.trainer.tensorboard, cfg.trainer.wandb, cfg.to_dict()) \
            if self.is_main else None
        self._tasks = None
        self.eval_episodes: list[Episode] = []
        self._rollout_stats: dict[str, float] = {}
        self._sync_stats: dict[str, float] = {}  # the last server weight sync (time, check), logged per step

    def _claim_run_folder(self) -> str:
        """Rank 0 reads or writes the run folder's marker (``agentrl.checkpoint.claim_run_folder``); every
        rank gets its run id, or the same one-line error."""
        found: tuple[str | None, str | None] = (None, None)
        if self.is_main:
            about = dict(recipe=self.cfg.recipe, env=self.cfg.env, model=str(self.cfg.model.name))
            try:
                found = (ckpt.claim_run_folder(self.out_dir, about), None)
            except RunError as e:
                found = (None, str(e))
            except OSError as e:
                found = (None, f"cannot write the run folder {self.out_dir}: {e.strerror or e}; choose another "
                               "trainer.out_dir (--out)")
        run_id, error = dist.broadcast_object(found)
        if error:
            raise RunError(error)
        return str(run_id)

    def _resolve_device(self) -> str:
        try:
            return dist.resolve_device(self.cfg.trainer.device)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _check_launch(self) -> None:
        c, n = self.cfg, dist.launched_world()
        if c.trainer.engine == "deepspeed":
            from agentrl.learner.deepspeed_engine import DeepSpeedConfigError, load_ds_config

            try:
                load_ds_config(c.trainer.deepspeed_config or None)
            except DeepSpeedConfigError as e:
                raise ConfigError(str(e)) from None
            if c.model.lora_r:
                raise ConfigError("LoRA under trainer.engine=deepspeed is not supported yet (the in-memory weight sync "
                                  "copies full weights); use trainer.engine=torch with model.lora_r")
        if c.trainer.generator == "remote" and not c.trainer.generator_url:
            raise ConfigError("trainer.generator=remote needs trainer.generator_url")
        if c.trainer.generator == "vllm" and not c.trainer.generator_url and c.trainer.vllm_servers < 1:
            raise ConfigError("trainer.generator=vllm needs trainer.generator_url or trainer.vllm_servers >= 1")
        if n <= 1:
            return
        if c.trainer.engine != "deepspeed":
            raise ConfigError(f"{n} ranks were launched but trainer.engine={c.trainer.engine} trains in one process; "
                              "add trainer.engine=deepspeed (ZeRO-3 over the ranks) or launch one process")
        if c.rollout.groups < n:
            raise ConfigError(f"rollout.groups={c.rollout.groups} is fewer than the {n} ranks: each rank rolls out "
                              f"whole groups, so set rollout.groups >= {n} (or launch fewer ranks)")

    # ----- parts -------------------------------------------------------------------------------
    def _make_engine(self) -> "LearnerEngine":
        c = self.cfg
        ecfg = EngineConfig(optim=OptimConfig(lr=c.optim.lr, weight_decay=c.optim.weight_decay,
                                              grad_clip=c.optim.grad_clip, warmup_steps=c.optim.warmup_steps),
                            lora=LoraSettings(r=c.model.lora_r, alpha=c.model.lora_alpha) if c.model.lora_r else None,
                            value_head=self.recipe.estimator().needs_values, critic=c.algo.critic,
                            critic_path=c.algo.critic_path, critic_lr=c.optim.critic_lr,
                            token_budget=c.optim.token_budget,
                            dtype=c.model.dtype, seed=c.trainer.seed, device=self.device, autocast=c.model.autocast,
                            compile=c.model.compile)
        if c.trainer.engine == "deepspeed":
            from agentrl.learner.deepspeed_engine import DeepSpeedConfigError, DeepSpeedEngine

            try:
                return DeepSpeedEngine(self.model_dir, ecfg, c.trainer.deepspeed_config or None)
            except (DeepSpeedConfigError, NotImplementedError) as e:
                raise ConfigError(str(e)) from None
        return TorchEngine(self.model_dir, ecfg)

    def _make_generator(self) -> "Generator":
        if self.cfg.trainer.generator == "vllm":
            from agentrl.generation.vllm_fleet import VLLMFleet

            fleet = VLLMFleet(self.cfg.trainer, self.model_dir, self.device, self.out_dir,
                              lora=bool(self.cfg.model.lora_r))
            try:  # before any work: a server of another model, or one that cannot take weights in place
                if self.cfg.trainer.check_sync:
                    fleet.verify(self.engine)  # serves what the learner starts from
                fleet.receive(self.engine, self.out_dir)  # takes weights in place
            except Exception:
                fleet.close()
                raise
            return fleet
        if self.cfg.trainer.generator == "remote":
            from agentrl.generation.client import RemoteGenerator

            gen = RemoteGenerator(self.cfg.trainer.generator_url)
            gen.wait_ready()
            return gen
        from agentrl.generation.embedded import EmbeddedGenerator
        from agentrl.learner.models import stop_token_ids

        model = getattr(self.engine, "model", None)
        if model is None or self._producer is not None:
            # DeepSpeed, or the overlap (the producer samples while the learner trains): a copy of the policy,
            # refreshed in memory after each update
            return EmbeddedGenerator.from_folder(self.model_dir, self.cfg.model.dtype, self.device)
        # The torch engine's own module: rollouts always see the latest weights, no copy to sync.
        return EmbeddedGenerator(model, self.tokenizer, stop_token_ids(self.tokenizer, model.config), self.device)

    def _make_envs(self) -> "EnvSlots":
        from agentrl.envs.registry import make_pool

        r = self.cfg.rollout
        # each rank owns its own slots (its actors under Ray, as its worker processes otherwise)
        opts = dict(address=self.cfg.trainer.ray_address, slots_per_actor=r.ray_slots_per_actor,
                    num_cpus=r.ray_num_cpus, memory_mb=r.ray_memory_mb, resources=r.ray_resources) \
            if r.pool == "ray" else {}
        return make_pool(r.pool, self.cfg.env, r.slots, self.cfg.env_kwargs, **opts)

    def rollout_config(self, temperature: float | None = None, max_turns: int | None = None) -> RolloutConfig:
        r = self.cfg.rollout
        spec = self.envs.call(0, "prompt_spec")
        stops = [f"</{spec.answer_tag}>"]
        return RolloutConfig(max_turns=max_turns or r.max_turns, history_len=r.history_len, chat_mode=r.chat_mode,
                             require_think=r.require_think, format_penalty=r.format_penalty,
                             ineffective_penalty=r.ineffective_penalty,
                             max_actions_per_turn=r.max_actions_per_turn or None,
                             max_episode_actions=r.max_episode_actions,
                             show_admissible=r.show_admissible, constrain_actions=r.constrain_actions,
                             prompt=r.prompt, refill=r.refill, mode=r.mode, context_overflow=r.context_overflow,
                             sampling=SamplingParams(temperature=r.temperature if temperature is None else temperature,
                                                     top_p=r.top_p, max_new_tokens=r.max_new_tokens, stop=stops,
                                                     seed=self.rng.randrange(2**31)))

    # ----- services the recipes use ----------------------------------------------------------------
    def task_ids(self, split: str) -> list[str]:
        return [t.task_id for t in self.envs.call(0, "tasks", split)]

    def sample_tasks(self, n: int, split: str | None = None) -> list[tuple[str, int]]:
        ids = self.task_ids(split or self.cfg.rollout.split)
        return [(self.rng.choice(ids), self.rng.randrange(2**31)) for _ in range(n)]

    def echo(self, text: str) -> None:
        """A line for the user (rank 0 only)."""
        if self.is_main:
            print(text, flush=True)

    def rollout(self, starts: list[Start], temperature: float | None = None, max_turns: int | None = None
                ) -> list[Episode]:
        """Episodes for ``starts``, in order, on every rank. Each rank rolls out its share (whole groups,
        ``dist.shard_groups``) and the shares are all-gathered. Each start samples from its own stream
        (rollout seed, start index), so an episode's tokens do not depend on which rank ran it."""
        cfg = self.rollout_config(temperature, max_turns)
        streams = [mix_seed(cfg.sampling.seed, i) for i in range(len(starts))]
        mine = dist.shard_groups([s.group_id or f"#{i}" for i, s in enumerate(starts)], self.world)[self.rank]
        engine = RolloutEngine(self.generator, self.tokenizer, self.envs, self.cfg.env, cfg)
        local, error = [], None
        try:
            local = engine.run([starts[i] for i in mine], [streams[i] for i in mine])
        except Exception as e:  # raised at the gather, on every rank (the others would wait there for this one)
            error = e
        eps, stats = dist.all_gather_ordered(len(starts), mine, local, engine.stats, error=error)
        for e in eps:  # the weights they were drawn with: the overlap's producer samples a step behind
            for turn in e.turns:
                turn.policy_version = self.policy_version
        # summed over the step's rollout calls (reset in ``train``); counts summed over ranks, times (``*_s``)
        # the slowest rank's, since the ranks wait for each other at the gather
        for k in engine.stats:
            vals = [st[k] for st in stats]
            self._rollout_stats[k] = self._rollout_stats.get(k, 0.0) + (max(vals) if k.endswith("_s") else sum(vals))
        return eps

    @property
    def policy_version(self) -> int:
        """The updates the generator's weights have seen: the step (the producer's view says its own)."""
        return self.step

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        """Plain completions (LEAFE's reflections), sharded over the ranks like ``rollout``; row i samples
        from stream (sampling.seed, i)."""
        seed = sampling.seed if sampling.seed is not None else self.rng.randrange(2**31)
        seeds = [mix_seed(seed, i) for i in range(len(prompts))]
        mine = list(range(self.rank, len(prompts), self.world))
        local, error = [], None
        try:
            local = self.generator.generate([prompts[i] for i in mine], sampling, seeds=[seeds[i] for i in mine])
        except Exception as e:  # as in ``rollout``
            error = e
        return dist.all_gather_ordered(len(prompts), mine, local, error=error)[0]

    @property
    def needs_reference(self) -> bool:
        a = self.cfg.algo
        return (a.kl != "none" and a.kl_coef > 0) or a.kl_reward_coef > 0

    def reference_folder(self) -> Path | None:
        """What KL terms measure against: the warm start (the SFT-only policy) when there is one, else the
        model the run started from. With LoRA that is the engine's own model with its adapters off (None: no
        copy), unless this run's SFT trained the adapters: then only the warm start's copy is that policy."""
        warm = self.out_dir / "warm_start"
        made = (warm / "config.json").exists()
        if self.cfg.model.lora_r and (self.cfg.sft.warm_start or not made):
            return None
        return warm if made else self.model_dir

    def update(self, samples: list[Sample], loss_fn: "LossFn", need_values: bool = False) -> dict[str, float]:
        batch = collate(samples, self.engine.pad_id)
        if self.cfg.algo.kl != "none" and self.cfg.algo.kl_coef > 0:  # only the loss's KL term reads them
            batch.ref_logprobs = self.engine.ref_logprobs(batch, self.cfg.rollout.temperature)
        t = time.perf_counter()
        stats: dict[str, float] = {}
        a = self.cfg.algo
        if (not need_values and not bool((batch.advantages * batch.loss_mask).abs().gt(0).any())
                and not (a.kl != "none" and a.kl_coef) and not a.entropy_coef):
            # Every advantage is zero (all groups all-fail or all-succeed): the gradient is exactly zero,
            # but Adam's momentum would still move the weights. No signal, no step.
            return dict(skipped_update=1.0, loss=0.0, grad_norm=0.0, time_learn_s=time.perf_counter() - t)
        decoupled = self._decouple(batch) if self._stale else {}
        order = list(range(len(batch)))
        n_mb = -(-len(order) // a.mini_batch_samples) if a.mini_batch_samples > 0 else a.mini_batches
        n_mb = max(1, min(n_mb, len(order)))
        sums: dict[str, float] = {}
        n_steps = skipped = 0
        for _ in range(a.ppo_epochs):
            if n_mb > 1:
                self.rng.shuffle(order)
            for part in (order[i::n_mb] for i in range(n_mb)):
                mb = batch if n_mb == 1 else batch.select(sorted(part))
                s = self.engine.step(mb, loss_fn, temperature=self.cfg.rollout.temperature,
                                     need_entropy=True, need_values=need_values,
                                     weight_by="tokens" if a.agg == "token-mean" else "sequences")
                if self._nonfinite_step(s):  # not applied (StepGuard); skip policy: left out of the means
                    skipped += 1
                    continue
                for k, v in s.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                n_steps += 1
        stats = {k: v / max(1, n_steps) for k, v in sums.items()}  # means over the optimizer steps
        stats["optim_steps"] = float(n_steps)
        stats.update(decoupled)
        if self.cfg.trainer.nan_policy == "skip":
            stats["nonfinite_skipped"] = float(skipped)
        if not params_finite(self.engine):  # one max-abs reduction: finite gradients can still overflow a weight
            raise RunError(f"step {self.step + 1}: the weights hold non-finite values after this update; the run "
                           f"stops without saving them (the last checkpoint is {self.out_dir / CHECKPOINT_LINK}). "
                           "Lower optim.lr (or optim.grad_clip) and resume with the same command")
        self.sync_weights()
        stats["time_learn_s"] = time.perf_counter() - t
        return stats

    def _decouple(self, batch: Any) -> dict[str, float]:
        """Samples drawn by older weights (the overlap): AReaL's decoupled PPO objective. The surrogate's ratio
        is taken against the proximal policy (these weights before the update, one extra forward pass) and
        each token's advantage is weighted by the truncated behaviour ratio pi_prox / pi_behav
        (``behaviour_weights``); both are fixed over the update's epochs and mini-batches."""
        from agentrl.algos.losses import behaviour_weights

        prox = self.engine.logprobs(batch, self.cfg.rollout.temperature)
        w, stats = behaviour_weights(prox, batch.old_logprobs, batch.loss_mask)
        batch.old_logprobs, batch.advantages = prox, batch.advantages * w
        return stats

    def _overlapped_step(self) -> dict[str, float]:
        """One step with trainer.max_staleness > 0: this step's episodes were collected during the last step
        (by the generator's weights of then); the next step's are collected now, in a producer thread, while
        this one learns. The new weights reach the generator once that collect is done, so a sample is one
        update old when trained on (the first step's, collected now, none)."""
        p = self._producer
        got = p.take(self, self.recipe.collect, self.step)
        # also on the last step: its checkpoint carries the collect, so a run trained on later goes on exactly
        p.start(self, self.recipe.collect, self.step + 1, self.policy_version)
        gaps = [self.step - t.policy_version for e in got.episodes for t in e.turns if t.gen_ids]
        self._rollout_stats, self._stale = got.rollout_stats, any(gaps)
        try:
            metrics = self.recipe.learn(self, got.episodes, got.stats)
        except BaseException:
            p.join(raise_error=False)
            raise
        finally:
            self._stale = False
        p.join()
        if self._sync_due:
            self._sync_due = False
            self.sync_weights()
        metrics.update(staleness_mean=sum(gaps) / max(1, len(gaps)), staleness_max=float(max(gaps, default=0)))
        return metrics

    def _nonfinite_step(self, s: dict[str, float]) -> bool:
        """Whether an optimizer step's loss or gradient norm is NaN or infinite (both are global under
        DeepSpeed, so every rank decides alike). ``trainer.nan_policy=stop`` ends the run here."""
        vals = {k: float(s[k]) for k in ("loss", "grad_norm") if k in s}
        if all(math.isfinite(v) for v in vals.values()):
            return False
        if self.cfg.trainer.nan_policy == "skip":
            return True
        shown = ", ".join(f"{k} {v}" for k, v in vals.items())
        raise RunError(f"step {self.step + 1}: non-finite {shown} (trainer.nan_policy=stop): the run stops and this "
                       f"update is neither applied nor saved; the last checkpoint is {self.out_dir / CHECKPOINT_LINK}. "
                       "Lower optim.lr or check the rewards and resume with the same command, or set "
                       "trainer.nan_policy=skip to drop such updates and count them (nonfinite_skipped)")

    def values(self, samples: list[Sample]) -> list[float]:
        """Critic value at the last prompt token of each sample (PPO)."""
        batch = collate(samples, self.engine.pad_id)
        _, vals = self.engine.logprobs(batch, values=True)
        return [float(vals[i, s.loss_mask.index(1) - 1]) for i, s in enumerate(samples)]

    def token_values(self, samples: list[Sample]) -> list[list[float]]:
        """Critic value before every generated token of each sample, in order (token-level GAE): the value
        head's output at the position that predicts the token."""
        batch = collate(samples, self.engine.pad_id)
        _, vals = self.engine.logprobs(batch, values=True)
        return [[float(vals[b, i - 1]) for i, m in enumerate(s.loss_mask) if m] for b, s in enumerate(samples)]

    def sync_weights(self) -> None:
        """After an update the generator must sample from the new policy (see ``Generator.receive``:
        nothing to do for the learner's own module, an in-memory copy per rank under DeepSpeed, an
        exported folder for our server, an in-place push and check for vLLM servers). While the overlap's
        producer samples with the generator, the push waits for its collect to end."""
        if self._producer is not None and self._producer.busy:
            self._sync_due = True
            return
        self._sync_stats = self.generator.receive(self.engine, self.out_dir)

    def diagnostics(self, episodes: list[Episode], recipe: "Recipe") -> dict[str, float]:
        """Collective (every rank calls it in ``Recipe.step``): episode statistics, timings, and the env
        workers' restarts, timeouts, crashes, replays and dropped episodes this step, summed over ranks."""
        d = episode_diagnostics(episodes, recipe.reward)
        st = self._rollout_stats
        d.update(time_generate_s=st.get("generate_s", 0.0), time_env_s=st.get("env_s", 0.0),
                 context_trimmed=st.get("context_trimmed", 0.0), context_ended=st.get("context_ended", 0.0))
        now = dict(self.envs.stats)
        delta = {k: v - self._pool_seen.get(k, 0) for k, v in now.items()}
        self._pool_seen = now
        gathered = dist.all_gather_object(delta)
        for k in delta:
            d[f"env_{k}"] = float(sum(x.get(k, 0) for x in gathered))
        return d

    # ----- evaluation --------------------------------------------------------------------------
    def evaluate(self, n_tasks: int | None = None, samples: int | None = None, split: str | None = None,
                 ks: tuple[int, ...] | None = None, temperature: float | None = None) -> dict[str, float]:
        e = self.cfg.eval
        split, n_tasks, samples = split or e.split, n_tasks or e.tasks, samples or e.samples
        if ks is None:  # pass@1, 2, 4, ... up to the samples drawn per task
            ks = tuple(2 ** i for i in range(samples.bit_length()) if 2 ** i <= samples) + (samples,)
        ids = self.task_ids(split)[:n_tasks]
        starts = [Start(t, 1000 + i, f"eval:{t}") for i, t in enumerate(ids) for _ in range(samples)]
        eps = self.rollout(starts, temperature=e.temperature if temperature is None else temperature)
        self.eval_episodes = eps  # the last evaluation's episodes, for per-task reports (agentrl eval)
        out = episode_diagnostics(eps, lambda ep: float(ep.won), prefix="eval/")
        by_task: dict[str, list[bool]] = {}
        for ep in eps:
            by_task.setdefault(ep.task_id, []).append(ep.won)
        for k in sorted({1, *ks}):
            if k <= samples:
                out[f"eval/pass@{k}"] = sum(pass_at_k(len(w), sum(w), k) for w in by_task.values()) / len(by_task)
        # per task category (ALFWorld's task types, TextWorld's difficulties), where the env has them
        category = {t.task_id: t.category for t in self.envs.call(0, "tasks", split)}
        by_cat: dict[str, list[bool]] = {}
        for ep in eps:
            if category.get(ep.task_id):
                by_cat.setdefault(category[ep.task_id], []).append(ep.won)
        if len(by_cat) > 1:
            out.update({f"eval/success/{c}": sum(w) / len(w) for c, w in sorted(by_cat.items())})
        return out

    # ----- checkpoints -------------------------------------------------------------------------
    def _check_free_space(self) -> None:
        """Before any work: room for ``keep_checkpoints`` + 1 checkpoints (weights and Adam's two moments each;
        the kept ones stay until the new one is sealed), so a full disk is an error now, not at a save."""
        weights = sum(f.stat().st_size for f in Path(self.model_dir).glob("*.safetensors"))
        need = (self.cfg.trainer.keep_checkpoints + 1) * 3 * weights
        free = shutil.disk_usage(self.out_dir).free
        if need and free < need:
            raise RunError(f"{self.out_dir}: {free / 2**30:.2f} GiB free, a run of this model needs about "
                           f"{need / 2**30:.2f} GiB for its checkpoints; free space or choose another trainer.out_dir")

    def save_checkpoint(self) -> Path:
        """Collective. Every rank writes its part (ZeRO shards, its RNG) into ``checkpoints/step-N``, rank 0
        the trainer and recipe state; then rank 0 seals it (a manifest with every file's sha256, written last),
        switches the ``checkpoint`` link to it (an atomic rename) and removes this run's checkpoints beyond
        ``trainer.keep_checkpoints``: a kill at any point leaves the previous complete checkpoints, and nothing
        the run did not write is ever removed (``agentrl.checkpoint``)."""
        root = self.out_dir / "checkpoints"
        folder = root / f"step-{self.step:06d}"
        if not params_finite(self.engine):
            raise RunError(f"step {self.step}: the weights hold non-finite values; they are not saved (the last "
                           f"checkpoint is {self.out_dir / CHECKPOINT_LINK}). Lower optim.lr and resume with the "
                           "same command")
        error = None
        if self.is_main:
            try:
                ckpt.clear_for_save(folder, self.run_id)  # only a save of this step by this run
                ckpt.begin(folder, self.run_id, self.step)
            except RunError as e:
                error = str(e)
            except OSError as e:
                error = (f"checkpoint at step {self.step} could not start ({e.strerror or e}); the last complete one "
                         f"is {self.out_dir / CHECKPOINT_LINK}. Free space and run the same command to resume")
        error = dist.broadcast_object(error)
        if error:
            raise RunError(error)
        try:
            self.engine.save(folder)
            if self.is_main:
                torch.save(dict(step=self.step, env_steps=self.env_steps, rng=self.rng.getstate(),
                                recipe=ckpt.to_plain(self.recipe.state_dict(), "recipe state"), world=self.world,
                                engine=self.cfg.trainer.engine, config=self.cfg.to_dict(), **self._in_flight()),
                           folder / "trainer.pt")
            dist.barrier()
            if self.is_main:
                ckpt.seal(folder, self.run_id, self.step)
        except ckpt.WRITE_ERRORS as e:  # a full disk: drop the partial save (this run's), keep the previous one, say so
            raise ckpt.write_failed(e, folder, self.out_dir / CHECKPOINT_LINK, remove=self.is_main) from None
        if self.is_main:
            ckpt.point_link(self.out_dir, folder)
            ckpt.rotate(root, self.cfg.trainer.keep_checkpoints, self.run_id, folder)
        dist.barrier()
        return folder

    def _in_flight(self) -> dict[str, Any]:
        """The overlap's collected step not yet trained on (its episodes with their versions), as plain
        containers: a resumed run trains on the very episodes the uninterrupted one would."""
        got = self._producer.pending if self._producer is not None else None
        return dict(collected=ckpt.to_plain(got, "collected step")) if got is not None else {}

    def _verify_checkpoints(self) -> dict[Path, str | None]:
        """Rank 0 verifies the complete checkpoints against their manifests, newest first, up to the first intact
        one; every rank gets each verdict (None: intact). Run before anything is written (config.yaml, tb/): with
        checkpoints but none intact it raises ``load_checkpoint``'s one line, whose "nothing was changed" holds."""
        root = self.out_dir / "checkpoints"
        verdicts: dict[str, str | None] = {}
        if self.is_main:
            for folder in ckpt.sealed_checkpoints(root):
                verdicts[str(folder)] = ckpt.verify(folder)
                if verdicts[str(folder)] is None:
                    break
        verdicts = dist.broadcast_object(verdicts)
        if all(why is not None for why in verdicts.values()):
            target, dangling = ckpt.link_target(self.out_dir)
            skipped = [(Path(f), str(why)) for f, why in verdicts.items()]
            if skipped or dangling or (target is not None and (target / "trainer.pt").exists()):
                raise RunError(self._nothing_to_resume(root, target, dangling, skipped))
        return {Path(f): why for f, why in verdicts.items()}

    def load_checkpoint(self) -> bool:
        """Resume from the newest intact checkpoint: rank 0 verifies each complete one (newest first) against
        its manifest (the verdicts taken before the run folder was written are reused), every rank loads the
        first that passes (weights_only, finite weights). Falling back says so in one line and renames the
        corrupt ones ``corrupt-step-N``; with none intact the run stops with one line and no checkpoint
        changed. False: nothing to resume (a new run)."""
        root = self.out_dir / "checkpoints"
        target, dangling = ckpt.link_target(self.out_dir)
        verdicts, self._verdicts = self._verdicts or {}, None  # once: a second call verifies afresh
        folders = [Path(f) for f in dist.broadcast_object(
            [str(f) for f in ckpt.sealed_checkpoints(root)] if self.is_main else None)]
        skipped: list[tuple[Path, str]] = []
        for folder in folders:
            why = verdicts[folder] if folder in verdicts else \
                dist.broadcast_object(ckpt.verify(folder) if self.is_main else None)
            if why is None:
                why = self._load_from(folder)
            if why is None:
                self._after_resume(folder, target, dangling, skipped)
                return True
            skipped.append((folder, why))
        if skipped or dangling or (target is not None and (target / "trainer.pt").exists()):
            # found only on loading (non-finite weights, a trainer.pt without a key): config.yaml is written by now
            raise RunError(self._nothing_to_resume(root, target, dangling, skipped, before_writes=False))
        return False

    def _load_from(self, folder: Path) -> str | None:
        """Load ``folder`` into the trainer, engine and recipe; None, or why it cannot be (on any rank)."""
        why = None
        try:
            state = ckpt.load_plain(folder / "trainer.pt")
            saved_world = state.get("world", 1)
            saved_engine = state.get("engine") or ("deepspeed" if (folder / "deepspeed").exists() else "torch")
            if saved_world != self.world or saved_engine != self.cfg.trainer.engine:
                raise ConfigError(f"{folder} was written by {saved_world} rank(s) with trainer.engine={saved_engine}; "
                                  f"this run has {self.world} with trainer.engine={self.cfg.trainer.engine}. Resume "
                                  "with the same launch, or start a new run (another trainer.out_dir)")
            recipe_state = ckpt.from_plain(state["recipe"])
            self.engine.load(folder)
            if not params_finite(self.engine):  # checksums vouch for the bytes, not for what was saved
                raise ckpt.CheckpointCorrupt("its weights hold non-finite values (NaN or infinity)")
        except ckpt.CheckpointCorrupt as e:
            why = str(e)
        except (KeyError, AttributeError) as e:
            why = f"trainer.pt lacks {e}"
        whys = [w for w in dist.all_gather_object(why) if w]
        if whys:
            return whys[0]
        self.step = state["step"]
        # checkpoints from before the budget existed: the steps are in the metrics logged up to this one
        self.env_steps = state["env_steps"] if "env_steps" in state else int(sum(
            r.get("env_steps", 0) for r in read_metrics(self.out_dir) if 0 < r.get("step", 0) <= self.step))
        self.rng.setstate(state["rng"])
        self.recipe.load_state_dict(recipe_state)
        if self._producer is not None:
            self._producer.pending = ckpt.from_plain(state["collected"]) if "collected" in state else None
        self.sync_weights()
        return None

    def _after_resume(self, folder: Path, target: Path | None, dangling: bool,
                      skipped: list[tuple[Path, str]]) -> None:
        """Point the link at the checkpoint resumed from; say why it is not the newest, if it is not."""
        notes = []
        if dangling and target is not None:
            notes.append(f"{self.out_dir / CHECKPOINT_LINK} pointed to {target.name}, which is missing")
        if self.is_main:
            if target is None or target.resolve() != folder.resolve():
                ckpt.point_link(self.out_dir, folder)
            for bad, why in skipped:
                kept = ckpt.quarantine(bad)
                notes.append(f"checkpoint {bad.name} is corrupt ({why}; kept as checkpoints/{kept.name})")
        if notes:
            self.echo("; ".join(notes) + f": resumed from {folder.name} (step {self.step}) instead")
        dist.barrier()

    def _nothing_to_resume(self, root: Path, target: Path | None, dangling: bool,
                           skipped: list[tuple[Path, str]], before_writes: bool = True) -> str:
        link = self.out_dir / CHECKPOINT_LINK
        if skipped:
            what = "; ".join(f"{f.name}: {why}" for f, why in skipped)
            head = f"no intact checkpoint to resume in {root} ({what})"
        elif dangling and target is not None:
            head = f"{link} points to {target.name}, which is missing, and {root} holds no other complete checkpoint"
        else:
            head = (f"{target} has no manifest (written by an agentrl from before checkpoints carried checksums): "
                    "it cannot be verified, so it is not resumed")
        what = "Nothing was" if before_writes else "No checkpoint was"
        return (head + f". {what} changed or deleted; to start over, choose another trainer.out_dir (--out) "
                "or move this run folder away")

    # ----- the run -----------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Train until ``trainer.steps`` (or the env-step or time budget), resuming from the run folder's
        checkpoint if it has one; returns the last evaluation's metrics (``eval/...``, also in final.json)."""
        resumed = self.load_checkpoint()
        if resumed and self.finished():
            self.echo(f"{self.out_dir} is a finished run (step {self.step} of {self.cfg.trainer.steps}, "
                      f"{self.env_steps} env steps); its final.json is kept. Raise trainer.steps (or "
                      "trainer.env_steps) to train on, or use another trainer.out_dir")
        else:
            if resumed:
                self.echo(f"resumed from {self.out_dir / CHECKPOINT_LINK} at step {self.step}")
            else:
                self._check_free_space()
            if self.is_main:  # rows logged after the checkpoint (and a torn last line) are redone, not repeated;
                truncate_metrics(self.out_dir, self.step if resumed else -1)  # a new start redoes step 0 too
        if self.step == 0 and not resumed:
            pre = self.recipe.before_training(self) if hasattr(self.recipe, "before_training") else {}
            first = self.evaluate() if self.cfg.eval.tasks and self.cfg.eval.at_start else {}
            self._log(0, {**pre, **first})
            self._print(0, first)
            if pre:  # a warm start (minutes of SFT) is not redone when the run is killed before its first checkpoint
                self.save_checkpoint()
        if self.needs_reference:
            self.engine.set_reference(self.reference_folder())
        progress = _Progress(self.cfg.trainer.steps, self.step, self.cfg.trainer.progress and self.is_main)
        final: dict[str, float] = {}
        history = read_metrics(self.out_dir)  # read once; the echo-trap check looks back over it
        try:
            while not self.finished():
                t = time.perf_counter()
                self._rollout_stats, self._sync_stats = {}, {}
                o = self.cfg.optim
                if o.schedule != "constant":
                    set_lr(self.engine, o.lr * lr_factor(self.step, self.cfg.trainer.steps, o.schedule))
                metrics = self._overlapped_step() if self._producer is not None else self.recipe.step(self)
                metrics.update(self._sync_stats)
                self.step += 1
                self.env_steps += int(metrics.get("env_steps", 0))
                metrics["env_steps_total"] = float(self.env_steps)
                metrics["time_step_s"] = time.perf_counter() - t
                history.append(metrics)
                metrics.update(echo_trap_flags(history))
                self._time_up = self._next_step_too_late(metrics["time_step_s"])  # decided once: finished() reads it
                e, last = self.cfg.eval, self.finished()
                regular = bool(e.every and self.step % e.every == 0)
                if self.cfg.eval.tasks and (regular or last):
                    rng = self.rng.getstate()
                    metrics.update(self.evaluate())
                    if not regular:  # the last step's extra reading leaves the run's random stream where a longer
                        self.rng.setstate(rng)  # run has it: a run trained on later goes on as one uninterrupted
                    final = {k: v for k, v in metrics.items() if k.startswith("eval/")}
                self._log(self.step, metrics)
                progress.update(self.step, metrics)
                if self.step % self.cfg.trainer.checkpoint_every == 0 or last:
                    self.save_checkpoint()
        finally:
            progress.close()
            if self.logger is not None:
                self.logger.close()
            trouble = {k: v for k, v in self.envs.stats.items() if v}
            if trouble and self.is_main:  # this rank's env workers over the whole run
                why = self.envs.last_error
                logging.getLogger(__name__).warning("env workers: %s%s", ", ".join(
                    f"{v} {k}" for k, v in sorted(trouble.items())), f" (last: {why})" if why else "")
        if not final:  # a finished run started again: nothing new
            final = self._last_final()
        if self.is_main:
            atomic_write_text(self.out_dir / "final.json", json.dumps(final, indent=1))
        return final

    def _last_final(self) -> dict[str, float]:
        """The run's last evaluation: final.json, or where an older version tore it, the last logged one."""
        try:
            final = json.loads((self.out_dir / "final.json").read_text())
            if isinstance(final, dict):
                return final
        except (OSError, ValueError):
            pass
        rows = [r for r in read_metrics(self.out_dir) if any(k.startswith("eval/") for k in r)]
        return {k: v for k, v in rows[-1].items() if k.startswith("eval/")} if rows else {}

    def finished(self) -> bool:
        """Every rank agrees: the step count and the env steps (summed over the gathered episodes) are global."""
        return self._budget_spent() or self._time_up

    def _budget_spent(self) -> bool:
        """trainer.steps or trainer.env_steps reached."""
        t = self.cfg.trainer
        return self.step >= t.steps or (t.env_steps > 0 and self.env_steps >= t.env_steps)

    def _next_step_too_late(self, step_s: float) -> bool:
        """trainer.time_limit_s: would one more step (as long as the longest so far) end past the limit? Rank 0's
        clock decides for every rank, so that all stop after the same step and evaluate it."""
        limit = self.cfg.trainer.time_limit_s
        if limit <= 0:
            return False
        self._longest_step = max(self._longest_step, step_s)
        elapsed = time.monotonic() - self._t0
        late = bool(dist.broadcast_object(elapsed + self._longest_step > limit))
        if late and not self._budget_spent():
            self.echo(f"trainer.time_limit_s={limit:g}: stopping after step {self.step} ({elapsed:.0f} s so far; a "
                      f"step takes up to {self._longest_step:.1f} s); its evaluation and checkpoint follow, and "
                      "the same command resumes from here")
        return late

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        if self.logger is not None:  # every row says how much memory the run has needed so far
            self.logger.log(step, {**metrics, "peak_rss_gib": peak_rss_gib()})

    def _print(self, step: int, m: dict[str, float]) -> None:
        if "eval/success" in m:
            cats = ", ".join(f"{k.rsplit('/', 1)[1]} {v:.2f}" for k, v in m.items() if k.startswith("eval/success/"))
            # the score is the success rate except where an env gives partial credit (WebShop, TextWorld)
            partial = m.get("eval/score", m["eval/success"]) != m["eval/success"]
            score = f", score {m['eval/score']:.3f}" if partial else ""
            self.echo(f"step {step}: eval success {m['eval/success']:.3f}{score} on {self.cfg.eval.tasks} "
                      f"{self.cfg.eval.split} tasks" + (f" ({cats})" if cats else ""))

    def close(self) -> None:
        self.recipe.close()
        self.generator.close()
        self.envs.close()
        self.engine.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Progress:
    """A rich progress bar with the key metrics, or plain lines when not on a terminal."""

    KEYS = ("success", "reward_mean", "in_group_reward_std", "loss", "eval/success")

    def __init__(self, total: int, start: int, enabled: bool):
        import sys

        self.bar = None
        self.plain = enabled and not sys.stdout.isatty()
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                TextColumn("{task.fields[info]}"))
            self.bar.start()
            self.task = self.bar.add_task("train", total=total, completed=start, info="")

    def update(self, step: int, m: dict[str, Any]) -> None:
        info = "  ".join(f"{k} {m[k]:.3f}" for k in self.KEYS if isinstance(m.get(k), (int, float)))
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif self.plain:
            print(f"step {step}: {info}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
