"""The rollout side of a run: rollouts, plain generation and task sampling, with their random stream and stats.

A ``RolloutSampler`` holds the run's generator, env slots and tokenizer, a random stream and the rollout
stats of the step it samples for. The trainer owns one whose stream is the run's own (``Run.rollout``,
``generate``, ``sample_tasks`` delegate to it); the overlap's producer (``agentrl.rollout.overlap``) takes
``for_step``'s copy per collected step: the same parts, but a stream of its own drawn from (run seed, step),
its own stats, and the step and weights version it collects for. It satisfies the rollout side of the run
protocol (``agentrl.run.RolloutSide``), so a recipe's ``collect`` can be handed either.

Under N ranks every method here is collective: each rank rolls out its share (whole groups) and the shares
are all-gathered, so every rank gets the same episodes in the same order.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agentrl import dist
from agentrl.rollout.engine import RolloutEngine
from agentrl.rollout.episode import RolloutConfig, Start
from agentrl.seeds import mix_seed
from agentrl.types import Completion, Episode, SamplingParams

if TYPE_CHECKING:
    from agentrl.config import RecipeCfg

COLLECT_STREAM = 0x0C0113C7  # tags a collected step's streams apart from every other use of the run seed


class RolloutSampler:
    """Rollouts and task draws for a run (see the module doc). ``clock``: the step the sampler samples for
    (the trainer's step, read at each call); ``version``: the weights version the generator holds, stamped
    on every turn (default: that step's)."""

    def __init__(self, cfg: RecipeCfg, generator: Any, tokenizer: Any, envs: Any, rng: random.Random,
                 clock: Callable[[], int], version: int | None = None, world: int = 1, rank: int = 0):
        self.cfg, self.generator, self.tokenizer, self.envs = cfg, generator, tokenizer, envs
        self.rng, self.world, self.rank = rng, world, rank
        self.is_main = rank == 0
        self._clock, self._version = clock, version
        # summed over the step's rollout calls; counts summed over ranks, times (``*_s``) the slowest rank's
        self.stats: dict[str, float] = {}

    @property
    def step(self) -> int:
        return self._clock()

    @property
    def policy_version(self) -> int:
        """The updates the generator's weights have seen when these rollouts are drawn."""
        return self.step if self._version is None else self._version

    def for_step(self, step: int, version: int) -> RolloutSampler:
        """Step ``step``'s sampler for the overlap's producer: the same parts, a stream of its own from (run
        seed, step) and stats of its own, so what it collects depends on the seed and the step only."""
        rng = random.Random(mix_seed(self.cfg.trainer.seed, COLLECT_STREAM, step))
        return RolloutSampler(self.cfg, self.generator, self.tokenizer, self.envs, rng, lambda: step, version,
                              self.world, self.rank)

    def echo(self, text: str) -> None:
        if self.is_main:
            print(text, flush=True)

    # ----- tasks -------------------------------------------------------------------------------
    def task_ids(self, split: str) -> list[str]:
        return [t.task_id for t in self.envs.call(0, "tasks", split)]

    def sample_tasks(self, n: int, split: str | None = None) -> list[tuple[str, int]]:
        ids = self.task_ids(split or self.cfg.rollout.split)
        return [(self.rng.choice(ids), self.rng.randrange(2**31)) for _ in range(n)]

    # ----- rollouts ----------------------------------------------------------------------------
    def rollout_config(self, temperature: float | None = None, max_turns: int | None = None) -> RolloutConfig:
        r = self.cfg.rollout
        spec = self.envs.call(0, "prompt_spec")
        stops = [f"</{spec.answer_tag}>"]
        sampling = SamplingParams(temperature=r.temperature if temperature is None else temperature, top_p=r.top_p,
                                  max_new_tokens=r.max_new_tokens, stop=stops, seed=self.rng.randrange(2**31))
        return RolloutConfig.of(r, sampling, max_turns)

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
        version = self.policy_version
        for e in eps:  # the weights they were drawn with: the overlap's producer samples a step behind; with
            for turn in e.turns:  # in-flight updates each token says, and the turn is as old as its oldest
                turn.policy_version = min(turn.gen_versions) if turn.gen_versions else version
        # the ranks wait for each other at the gather: a time is the slowest rank's
        for k in engine.stats:
            vals = [st[k] for st in stats]
            self.stats[k] = self.stats.get(k, 0.0) + (max(vals) if k.endswith("_s") else sum(vals))
        return eps

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
