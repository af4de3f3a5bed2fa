"""IPR (Xiong et al., 2024; the RRO paper's baseline): step-level process refinement along expert
trajectories. Each step, on ``tasks`` sampled training tasks:

* the expert's trajectory and one rollout of the agent from the task's start: when the agent's outcome is
  below the expert's, an outcome-level pair (expert trajectory > agent trajectory; DPO on each side's
  log-prob summed over its turns);
* at every step t of the expert's trajectory, ``max_candidates`` agent actions drawn from the expert's
  state; the process reward of each (the mean outcome of ``mc_rollouts`` policy rollouts after it) and of
  the expert's action; a step-level pair (expert action > agent action) for each candidate below the
  expert's reward;
* SFT on the expert's trajectories.

IPR minimizes the sum of the three losses; here they are fitted one after another within the step
(outcome-level DPO, step-level DPO, then SFT), each with the policy before it as the DPO reference.

The step is ``collect`` (the expert's trajectories, the agent's rollouts and the Monte Carlo values) then
``learn`` (the three fits). The collect hands its work on as episodes: each expert trajectory as one whose
turns hold the expert's prompts, its responses in ``info`` (the policy generated none of them), and the
agent's episodes and candidates that enter a pair, marked in their turns' ``info``. With
``trainer.max_staleness`` N the agent's side of every pair and the process rewards come from weights up to
N updates old; DPO and SFT need no importance correction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentrl.dpo import PreferencePair, TrajectoryPair, fit_dpo
from agentrl.envs.replay import Trace
from agentrl.learner.batch import Sample, turn_sample
from agentrl.recipe import RECIPES
from agentrl.recipes.rro import RRO, RROParams
from agentrl.rollout.engine import Start
from agentrl.sft import demo_turns, expert_demos, fit_sft
from agentrl.types import Episode, Turn

if TYPE_CHECKING:
    from agentrl.run import RolloutSide, Run


@dataclass
class IPRParams(RROParams):
    fixed_candidates: bool = True  # K agent actions at every expert step
    sft_epochs: int = 1  # passes of the SFT term over the step's expert trajectories


# Turn.info keys: an expert turn's response ids; an agent episode's outcome pair (its expert's index); a
# candidate's step pair [pair index, expert index, expert step, expert's reward, candidate's reward]
EXPERT_KEY, OUTCOME_KEY, STEP_KEY = "ipr_expert_ids", "ipr_outcome_pair", "ipr_step_pair"
EXPERT_GROUP = "ipr-expert:"  # an expert trajectory's group id, before its index


class IPR(RRO):
    Params = IPRParams

    def collect(self, trainer: "RolloutSide") -> tuple[list[Episode], dict[str, float]]:
        p, env, max_turns = self.p, self.cfg.env, self.cfg.rollout.max_turns
        cfg, tok = trainer.rollout_config(), trainer.tokenizer
        jobs = trainer.sample_tasks(p.tasks)
        demos = [d for d in expert_demos(env, self.cfg.env_kwargs, jobs) if d[0].actions]
        # the expert's responses without the end-of-text an SFT target carries: generation stops at the
        # answer's closing tag, so the agent's responses never hold one, and DPO must compare like with like
        full = [demo_turns(tok, cfg, d) for d in demos]
        turns = [[(pr, tg[:-1] if tg and tg[-1] == tok.eos_token_id else tg) for pr, tg in f] for f in full]
        # the agent's own trajectories from the same starts, for the outcome-level pairs
        agent = trainer.rollout([Start(d[0].task_id, d[0].seed, f"ipr-agent:{i}") for i, d in enumerate(demos)])
        experts = [Episode(env, d[0].task_id, d[0].seed, f"{EXPERT_GROUP}{i}",
                           turns=[Turn(pr, [], [], "", [], True, "", 0.0, False, info={EXPERT_KEY: tg})
                                  for pr, tg in f]) for i, (d, f) in enumerate(zip(demos, full))]
        outcome_pairs = []
        for i, (d, ep) in enumerate(zip(demos, agent)):
            expert_outcome = self.outcome_of(d[2][-1])
            if not ep.dropped and ep.turns and self.outcome(ep) < expert_outcome:
                ep.turns[0].info[OUTCOME_KEY] = i
                outcome_pairs.append(ep)
        # step level: K candidates at each expert state, the expert's action and each candidate valued by MC
        cand_starts, at = [], []
        for i, d in enumerate(demos):
            trace, observations = d[0], d[1]
            for t in range(min(len(trace.actions), max_turns)):
                history = list(zip(observations, trace.actions))[:t]
                for _ in range(p.max_candidates):
                    cand_starts.append(Start(trace.task_id, trace.seed, f"ipr:{i}:{t}", trace=trace, t0=t,
                                             reseed=trainer.rng.randrange(2**31), history=history, max_turns=1))
                    at.append((i, t))
        cands = trainer.rollout(cand_starts) if cand_starts else []
        mc_starts, mc_of = [], {}  # what each Monte Carlo estimate is for: ("expert", i, t) or ("cand", j)
        for i, d in enumerate(demos):
            trace, observations = d[0], d[1]
            for t in range(min(len(trace.actions), max_turns)):
                if t + 1 < len(trace.actions) and max_turns - t - 1 > 0:  # the expert's last action: its outcome
                    mc_of[("expert", i, t)] = len(mc_starts)
                    mc_starts.append(Start(trace.task_id, trace.seed, f"ipr-mc:{i}:{t}", trace=trace, t0=t + 1,
                                           reseed=trainer.rng.randrange(2**31),
                                           history=list(zip(observations, trace.actions))[:t + 1],
                                           max_turns=max_turns - t - 1))
        for j, ((i, t), ce) in enumerate(zip(at, cands)):
            turn = ce.turns[0] if ce.turns and not ce.dropped else None
            if turn is None or turn.done or max_turns - t - 1 <= 0:
                continue
            trace, observations = demos[i][0], demos[i][1]
            after = Trace(env, trace.task_id, trace.seed, trace.actions[:t] + turn.actions,
                          trace.fingerprints[:t + 1] + turn.fingerprints)
            mc_of[("cand", j)] = len(mc_starts)
            mc_starts.append(Start(trace.task_id, trace.seed, f"ipr-mc-c:{j}", trace=after,
                                   t0=t + len(turn.actions), reseed=trainer.rng.randrange(2**31),
                                   history=list(zip(observations, trace.actions))[:t]
                                   + ([(observations[t], " || ".join(turn.actions))] if turn.actions else []),
                                   max_turns=max_turns - t - 1))
        values = self._mc(trainer, mc_starts) if mc_starts else []
        step_pairs: list[Episode] = []
        for j, ((i, t), ce) in enumerate(zip(at, cands)):
            if not ce.turns or ce.dropped:
                continue
            turn = ce.turns[0]
            key = ("expert", i, t)
            expert_r = values[mc_of[key]] if key in mc_of else self.outcome_of(demos[i][2][-1])
            cand_r = values[mc_of[("cand", j)]] if ("cand", j) in mc_of else self.outcome(ce)
            expert_ids = turns[i][t][1]
            if cand_r < expert_r and turn.gen_ids != expert_ids:
                turn.info[STEP_KEY] = [len(step_pairs), i, t, expert_r, cand_r]
                step_pairs.append(ce)
        stats = dict(ipr_expert_trajectories=float(len(demos)), candidates_per_step=float(p.max_candidates),
                     agent_success=sum(float(e.won) for e in agent) / max(1, len(agent)),
                     ipr_mc_rollouts=float(len(mc_starts) * p.mc_rollouts))
        return experts + outcome_pairs + step_pairs, stats

    def learn(self, trainer: "Run", episodes: list[Episode], collected: dict[str, float]) -> dict[str, float]:
        outcome_pairs, step_pairs, sft = ipr_terms(episodes, trainer.tokenizer.eos_token_id)
        p = self.p
        stats = dict(collected)
        stats.update(fit_dpo(trainer, outcome_pairs, p.epochs, p.batch_size, p.lr, p.beta, prefix="outcome_dpo"))
        stats.update(fit_dpo(trainer, step_pairs, p.epochs, p.batch_size, p.lr, p.beta, prefix="dpo"))
        if sft:
            stats.update(fit_sft(trainer, sft, p.sft_epochs, p.batch_size, p.lr))
        return stats

    def outcome_of(self, info: dict[str, Any]) -> float:
        """The expert episode's outcome, on the scale ``outcome`` uses for the agent's."""
        return float(info.get("score", 0.0)) if self.cfg.algo.reward == "score" else float(bool(info.get("won")))



def ipr_terms(episodes: list[Episode], eos: int) -> tuple[list[TrajectoryPair], list[PreferencePair], list[Sample]]:
    """The three terms from a collect's episodes: outcome-level pairs (the expert's trajectory over the
    agent's), step-level pairs (the expert's action over a candidate's, on the candidate's prompt: the
    expert's state as the policy saw it), and the expert's turns as SFT rows. The expert's responses in the
    pairs go without the end-of-text an SFT target carries: the agent's responses never hold one."""
    experts = [e for e in episodes if e.group_id.startswith(EXPERT_GROUP)]

    def response(ids: list[int]) -> list[int]:
        return ids[:-1] if ids and ids[-1] == eos else ids

    expert_turns = [[(t.prompt_ids, response(t.info[EXPERT_KEY])) for t in e.turns] for e in experts]
    outcome, steps = [], []
    for e in episodes:
        first = e.turns[0] if e.turns else None
        if first is not None and OUTCOME_KEY in first.info:
            outcome.append(TrajectoryPair(expert_turns[first.info[OUTCOME_KEY]],
                                          [(t.prompt_ids, t.gen_ids) for t in e.turns], dict(task=e.task_id)))
        if first is not None and STEP_KEY in first.info:
            j, i, t, expert_r, cand_r = first.info[STEP_KEY]
            steps.append((j, PreferencePair(first.prompt_ids, expert_turns[i][t][1], first.gen_ids,
                                            dict(task=e.task_id, step=t, chosen=expert_r, rejected=cand_r))))
    sft = [turn_sample(t.prompt_ids, t.info[EXPERT_KEY], [0.0] * len(t.info[EXPERT_KEY]), 1.0)
           for e in experts for t in e.turns]
    return outcome, [pair for _, pair in sorted(steps, key=lambda x: x[0])], sft


RECIPES.register("ipr")(IPR)
