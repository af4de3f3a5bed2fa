"""Supervised data and fitting: expert demonstrations rendered as the policy's own prompts, and the
SFT loop (also the warm start of RL runs and the fit stage of RFT)."""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import os
import random
import shutil
import time
from typing import TYPE_CHECKING, Any, Callable

from agentrl import dist
from agentrl.algos.losses import sft_loss
from agentrl.learner.batch import Sample, collate, episode_sample, turn_sample
from agentrl.learner.loop import optimizer_loop
from agentrl.learner.lr import lr_factor
from agentrl.progress import Progress
from agentrl.generation.embedded import along_choices
from agentrl.rollout.engine import RolloutConfig, answer_choices, first_prompt_ids, followup_text
from agentrl.rollout.prompts import followup_user, numbered_actions
from agentrl.rollout.tool_prompts import action_text as tool_action_text
from agentrl.envs import make
from agentrl.envs.replay import play
from agentrl.types import Episode, Turn, turns_nest

if TYPE_CHECKING:
    from agentrl.run import Run


def answer_text(spec: Any, action: str, think: bool = False) -> str:
    """The response a demonstration teaches. ``think``: with ``rollout.require_think`` the format needs a
    think block; the expert has no reasoning to put in it, so it stays empty rather than invented. A tool
    env's action is written as the model writes it: a call in its parser's format, or the answer in tags."""
    if spec.style == "tools":
        return ("<think></think>" if think else "") + tool_action_text(spec, action)
    return ("<think></think>" if think else "") + f"<{spec.answer_tag}>{action}</{spec.answer_tag}>"


def _answer(action: str, numbered: list[str] | None) -> str:
    """What the policy writes for ``action``: the action, or its number in ``numbered`` (``numbered_actions``:
    None where the prompt numbers nothing)."""
    return str(numbered.index(action) + 1) if numbered and action in numbered else action


_DEMO_ENV: Any = None
SFT_LINE_EVERY_S = 10.0  # a progress line at least this often during SFT (and one at each pass's end)


def noisy_expert_episode(env: Any, task_id: str, seed: int, noise: float = 0.0
                         ) -> tuple[Any, list[str], list[dict[str, Any]], list[str]]:
    """The expert's episode, where each step with probability ``noise`` executes another action instead
    (DART): half the time a random admissible one, half the time the previous action again (a small
    policy's usual failure: ALFWorld answers "Nothing happens."). Returns trace (the executed actions),
    observations, infos and the expert's action at every visited state, which is each turn's training
    target. Off-path states then teach the policy to recover, which pure expert paths never show."""
    rng = random.Random(seed)
    labels: list[str] = []
    executed: list[str] = []

    def act(k: int) -> str | None:
        a = env.expert_action() if k < env.max_steps else None
        if a is None:
            return None
        labels.append(a)
        admissible = env.last_info.get("admissible_actions") or []
        if noise > 0 and admissible and rng.random() < noise:
            a = executed[-1] if executed and rng.random() < 0.5 else rng.choice(admissible)
        executed.append(a)
        return a

    trace, observations, infos = play(env, task_id, seed, act)
    return trace, observations, infos, labels


def _play_demo(job: tuple[str, dict, str, int, float]
               ) -> tuple[Any, list[str], list[dict[str, Any]], list[str], Any, str]:
    """One expert episode in a worker process (its env is made once per process)."""
    global _DEMO_ENV
    name, kwargs, task_id, seed, noise = job
    if _DEMO_ENV is None:
        _DEMO_ENV = make(name, **kwargs)
    trace, observations, infos, labels = noisy_expert_episode(_DEMO_ENV, task_id, seed, noise)
    return trace, observations, infos, labels, _DEMO_ENV.prompt_spec(), _DEMO_ENV.instruction()


def expert_demos(env_name: str, env_kwargs: dict, jobs: list[tuple[str, int]], workers: int = 1,
                 noise: float = 0.0, show: bool = False) -> list[Any]:
    """(trace, observations, infos, targets, prompt spec, instruction) per (task, seed), in order. With
    workers > 1 they are played in that many processes: a fresh clone's ALFWorld demos are mostly game
    generation (~0.5 s a game), which halves on two cores. The episodes are the same either way.
    ``show``: progress lines (or a bar) while they are played, since a first ALFWorld run builds its games here."""
    todo = [(env_name, env_kwargs, t, seed, noise) for t, seed in jobs]
    if workers == 0:  # one per core, at most 8 (each holds an env; ALFWorld's engine is ~80 MiB)
        workers = min(8, os.cpu_count() or 1)
    out: list[Any] = []
    won = 0
    with Progress(f"{env_name} demonstrations", len(todo), show) as progress:

        def keep(demo: Any) -> None:
            nonlocal won
            out.append(demo)
            won += bool(demo[2][-1].get("won"))
            progress.advance(info=f"expert success {won / len(out):.2f}")

        if workers <= 1 or len(todo) < 2 * workers:
            global _DEMO_ENV
            _DEMO_ENV = None
            try:
                for j in todo:
                    keep(_play_demo(j))
            finally:
                if _DEMO_ENV is not None:
                    _DEMO_ENV.close()
                _DEMO_ENV = None
            return out
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(workers) as pool:
            for demo in pool.imap(_play_demo, todo, chunksize=4):
                keep(demo)
        return out


def _seed_or_runs(trainer: "Run", seed: int) -> int:
    """An SFT input's own seed (sft.demo_seed, sft.order_seed), or the run's where it is -1."""
    return seed if seed >= 0 else trainer.cfg.trainer.seed


def expert_samples(trainer: "Run", n_episodes: int, split: str = "train", episodes: bool = True
                   ) -> tuple[list[Sample], float]:
    """Samples from the env's expert on ``n_episodes`` tasks; returns samples and expert success. Each turn
    trains on the prompt the policy will see there: windowed, or in full chat mode the growing chat, where a
    demonstration is one row (``demo_rows``) unless ``episodes`` is False (a study reading each turn's
    prompt) or ``sft.prompt_weight`` is set (its per-row prompt term is defined on per-turn rows)."""
    cfg = trainer.rollout_config()
    tok = trainer.tokenizer
    ids = trainer.task_ids(split)
    s = trainer.cfg.sft
    rng = random.Random(_seed_or_runs(trainer, s.demo_seed) + 17)
    jobs = [(task_id, rng.randrange(2**31)) for task_id in rng.sample(ids, min(n_episodes, len(ids)))]
    whole = episodes and cfg.chat_mode == "full" and not s.prompt_weight
    samples, wins, per_turn = [], 0, 0
    for (task_id, _), demo in zip(jobs, expert_demos(trainer.cfg.env, trainer.cfg.env_kwargs, jobs, s.workers,
                                                    s.noise, show=trainer.is_main and trainer.cfg.trainer.progress)):
        wins += bool(demo[2][-1].get("won"))
        rows = demo_rows(tok, cfg, demo, s.constrain_actions, {"task": task_id}, whole)
        per_turn += whole and len(rows) > 1  # a nested demonstration is always one row
        samples += rows
    if per_turn:
        trainer.echo(f"sft: {per_turn} of {len(jobs)} full-chat demonstrations train as one row a turn "
                     "(their turns' prompts do not extend each other token for token)")
    return samples, wins / max(1, len(jobs))  # fewer tasks than asked for: each is played once


def demo_rows(tok: Any, cfg: RolloutConfig, demo: tuple, choices: bool = False, meta: dict | None = None,
              whole: bool = False) -> list[Sample]:
    """One demonstration's training rows: a row a turn (its prompt, the expert's response as targets, weight
    1), or with ``whole`` and turns that nest token for token (``turns_nest``: a full chat's do) one row, the
    last turn's prompt and response with every turn's response masked in (``episode_sample``, as full-chat
    rollouts train). Under causal attention each target token then sees exactly the context its turn's row
    gave it, so the per-token log-probs are the same at a fraction of the tokens (a k-turn chat's turn rows
    repeat its first prompt k times). ``meta["sft_turns"]``: the turns the row holds (``sft_batches``)."""
    turns = []
    for prompt, target, options in demo_steps(tok, cfg, demo, choices):
        allowed = along_choices(target[:-1], options)  # None without sft.constrain_actions (no choices)
        if allowed is not None:  # decoding stops at a whole choice: no end-of-text token to learn
            target = target[:-1]
        turns.append(Turn(prompt, target, [0.0] * len(target), "", [], True, "", 0.0, False,
                          gen_allowed=allowed or []))
    meta = dict(meta or {})
    if whole and turns_nest(turns):
        ep = Episode("", meta.get("task", ""), 0, turns=turns)
        return [episode_sample(ep, [1.0] * len(turns), dict(meta, sft_turns=len(turns)))]
    return [turn_sample(t.prompt_ids, t.gen_ids, t.gen_logprobs, 1.0, meta, t.gen_allowed) for t in turns]


def demo_steps(tok: Any, cfg: RolloutConfig, demo: tuple, choices: bool = False
               ) -> list[tuple[list[int], list[int], list[list[int]] | None]]:
    """One demonstration (``expert_demos``'s tuple) as the policy would see and answer it, turn by turn:
    (prompt ids, the expert's response ids ending in end-of-text, with ``choices`` the answers constrained
    decoding would allow there (``answer_choices``), else None). The prompt is the rollouts': windowed
    (``rollout.history_len`` past steps), or under ``rollout.chat_mode: full`` the one growing chat, each
    turn's prompt the last one, the expert's answer and the next user message (a model trained on windowed
    prompts meets unseen ones from its second turn on)."""
    trace, observations, infos, labels, spec, instruction = demo
    eos = [tok.eos_token_id]
    out, history, cache, suffixes = [], [], {}, {}
    full = cfg.chat_mode == "full" and spec.style != "tools"  # a tool env's demo keeps its own chat
    for k, (label, executed) in enumerate(zip(labels, trace.actions)):
        listed = infos[k].get("admissible_actions")
        admissible = listed if cfg.show_admissible else None
        if full and out:
            last_prompt, last_target, _ = out[-1]
            prompt = last_prompt + last_target + tok(followup_text(
                tok, followup_user(spec, observations[k], admissible), "stop_id", suffixes),
                add_special_tokens=False)["input_ids"]
        else:
            prompt = first_prompt_ids(tok, cfg, spec, instruction, observations[k], history, k, admissible)
        numbered = numbered_actions(cfg, listed, history)
        target = tok(answer_text(spec, _answer(label, numbered), cfg.require_think),
                     add_special_tokens=False)["input_ids"] + eos
        allowed = None
        if choices:
            allowed = answer_choices(tok, spec.answer_tag, listed, numbered, cfg.sampling.max_new_tokens, cache)
        out.append((prompt, target, allowed))
        history.append((observations[k], executed))
    return out


def demo_turns(tok: Any, cfg: RolloutConfig, demo: tuple) -> list[tuple[list[int], list[int]]]:
    """``demo_steps`` without the choices: (prompt ids, the expert's response ids)."""
    return [(prompt, target) for prompt, target, _ in demo_steps(tok, cfg, demo)]


def row_turns(s: Sample) -> int:
    """The demonstration turns a row holds: a whole full-chat demonstration's (``demo_rows``), else 1."""
    return int(s.meta.get("sft_turns", 1))


def sft_batch_count(samples: list[Sample], batch_size: int) -> int:
    """Mini-batches a pass makes: one per ``batch_size`` turns (``row_turns``), at most one per row. A
    batch of whole-chat rows then holds about the turns, and target tokens, that a batch of turn rows did."""
    return min(len(samples), -(-sum(row_turns(s) for s in samples) // batch_size))


def _cut(rows: list[int], sizes: list[int], batch_size: int, n: int) -> list[list[int]]:
    """``rows`` (with ``sizes`` turns each) cut in order into ``n`` non-empty batches, each next one starting
    at the first row that the turns before it reach the next multiple of ``batch_size``. With one turn a row
    that is ``rows[i:i + batch_size]`` for each i, as before whole-chat rows."""
    before = list(itertools.accumulate(sizes, initial=0))[:-1]  # the turns ahead of each row
    bounds = [0]
    for j in range(1, n):
        b = bisect.bisect_left(before, j * batch_size)
        bounds.append(min(max(b, bounds[-1] + 1), len(rows) - (n - j)))
    bounds.append(len(rows))
    return [rows[a:z] for a, z in zip(bounds, bounds[1:])]


def sft_batches(samples: list[Sample], batch_size: int, rng: random.Random, by_length: bool = False) -> list[list[int]]:
    """One pass's mini-batches (sample indices), shuffled, ``sft_batch_count`` of them, each of about
    ``batch_size`` turns (a turn row is one, a whole-chat row its turns). ``by_length``: the rows of each
    run of 16 batches are sorted by length before they are cut again, so a batch pads to less (prompts of
    one env can vary 2x in length), and the batches are shuffled again so the lengths do not follow a trend
    through the pass."""
    order = list(range(len(samples)))
    rng.shuffle(order)
    turns = [row_turns(s) for s in samples]
    batches = _cut(order, [turns[j] for j in order], batch_size, sft_batch_count(samples, batch_size))
    if not by_length:
        return batches
    out = []
    for i in range(0, len(batches), 16):
        group = batches[i:i + 16]
        chunk = sorted((j for b in group for j in b), key=lambda j: len(samples[j].ids))
        out += _cut(chunk, [turns[j] for j in chunk], batch_size, len(group))
    rng.shuffle(out)
    return out


def term_weighted(rows: list[Sample], weights: dict[str, float]) -> list[Sample]:
    """Rows whose per-token weights make one batch's token-mean NLL equal sum_g w_g x (token-mean NLL of
    the rows of term g), each row's term in ``meta["sft_term"]``: a row of term g weighs w_g N / N_g per
    token (N tokens in the batch, N_g of term g). Exact under micro-batch accumulation too."""
    counts: dict[str, int] = {}
    for s in rows:
        counts[s.meta["sft_term"]] = counts.get(s.meta["sft_term"], 0) + sum(s.loss_mask)
    total = sum(counts.values())
    out = []
    for s in rows:
        g = s.meta["sft_term"]
        w = weights[g] * total / max(1, counts[g])
        out.append(dataclasses.replace(s, advantages=[w if m else 0.0 for m in s.loss_mask]))
    return out


def with_prompt_loss(s: Sample, weight: float) -> Sample:
    """The row with its prompt tokens as targets too: per row, weight x (the prompt's token-mean NLL) is
    added to the targets' token-mean NLL, each scaled by the row's target weight, whatever the lengths."""
    first = s.loss_mask.index(1)  # the first target; token 0 predicts nothing
    if first < 2 or not weight:
        return s
    a = s.advantages[first]
    per = weight * a * sum(s.loss_mask) / (first - 1)
    return dataclasses.replace(s, loss_mask=[0] + [1] * (first - 1) + s.loss_mask[first:],
                               advantages=[0.0] + [per] * (first - 1) + s.advantages[first:])


def passes_of(batches: int, per_pass: int) -> float:
    """SFT passes made after ``batches`` batches: whole at a pass's end, else to two decimals."""
    p = batches / max(1, per_pass)
    return float(int(p)) if p == int(p) else round(p, 2)


def still_rising(scores: list[float], patience: int = 1) -> bool:
    """Whether SFT should go on after these selection readings: fewer than ``patience`` readings since
    the first one that reached the best score."""
    return len(scores) - 1 - scores.index(max(scores)) < patience


def fit_sft(trainer: "Run", samples: list[Sample], epochs: int, batch_size: int, lr: float | None = None,
            schedule: str = "constant", by_length: bool = False,
            term_weights: dict[str, float] | None = None, max_epochs: int = 0,
            keep_going: Callable[[float], bool] | None = None, check_every: float = 1.0,
            stage: str = "") -> dict[str, float]:
    """Plain NLL on the target tokens, shuffled mini-batches, ``epochs`` passes, lr per ``schedule``.
    ``term_weights``: the loss is sum_g w_g x the token-mean NLL of term g's rows (``meta["sft_term"]``),
    each term normalized by its own tokens (LEAFE's L_cf + beta L_reh). With ``keep_going``, passes go on
    past ``epochs`` (up to ``max_epochs``) while ``keep_going(passes done)`` says so; it is asked after
    pass ``epochs`` and then every ``check_every`` passes (0.25: each quarter pass, where a pass moves
    success by 10-20 points), at the capped end too (its answer then only reads it), with the generator
    already holding those weights. ``passes done`` is a whole number at a pass's end, else a fraction.
    ``stage``: a later SFT stage's name (e.g. "cooldown"): its own shuffle from the seed, so it does not
    replay the first passes' order, and its name in the progress lines. ``sft.prompt_weight`` > 0: the
    prompts' tokens are targets too (``with_prompt_loss``)."""
    eng = trainer.engine
    base_lr = lr if lr is not None else eng.optimizer.param_groups[0]["lr"]
    seed = _seed_or_runs(trainer, trainer.cfg.sft.order_seed)
    prompt_weight = trainer.cfg.sft.prompt_weight
    rng = random.Random(f"{seed}{stage}" if stage else seed)

    def loss(mb: Any, out: Any) -> tuple[Any, dict[str, float]]:
        # a sample's advantages weigh its tokens (1.0 for plain SFT; LEAFE's rehearsal uses beta). The loss is
        # the token-mean NLL over every target token of the batch, whatever rows hold them: a whole-chat row
        # (demo_rows) adds its turns' response tokens as its turn rows did, and a batch holds about
        # batch_size turns either way (sft_batches), so sft.lr and sft.batch_size mean what they did
        return sft_loss(out["logp"] * mb.advantages, mb.loss_mask), {}

    losses: list[float] = []
    n_batches = sft_batch_count(samples, batch_size)
    t0 = time.perf_counter()
    shown = [t0]  # when the last progress line was printed
    last = max(epochs, max_epochs) if keep_going else epochs
    of = f"{epochs}-{last}" if last > epochs else str(epochs)
    asking = keep_going is not None and last > epochs
    every = max(1, round(check_every * n_batches))  # batches between readings after pass `epochs`

    def batches() -> Any:
        # lazily, pass by pass: each pass is shuffled when it starts, so stopping mid-pass draws nothing more
        for _ in range(last):
            for rows in sft_batches(samples, batch_size, rng, by_length):
                chosen = [samples[j] for j in rows]
                weighted = term_weighted(chosen, term_weights) if term_weights else chosen
                if prompt_weight:
                    weighted = [with_prompt_loss(r, prompt_weight) for r in weighted]
                yield collate(weighted, eng.pad_id)

    def after(k: int, s: dict[str, float]) -> bool:
        """Batch k done (``k + 1`` made): a progress line now and then, and the pass selection's reading."""
        losses.append(s["loss"])
        done, epoch, b = k + 1, k // n_batches, k % n_batches + 1
        if b == n_batches or time.perf_counter() - shown[0] >= SFT_LINE_EVERY_S:  # a long warm start is never silent
            shown[0] = time.perf_counter()
            trainer.echo(f"sft {stage + ' ' if stage else ''}pass {epoch + 1}/{of}: batch {b}/{n_batches}, "
                         f"loss {losses[-1]:.3f}, {shown[0] - t0:.0f}s")
        past = done - epochs * n_batches
        if asking and past >= 0 and (past % every == 0 or done == last * n_batches):
            trainer.sync_weights()
            return bool(keep_going(passes_of(done, n_batches)))
        return True

    scheduled = schedule != "constant"
    optimizer_loop(eng, batches(), loss, lr=base_lr if lr is not None or scheduled else None,
                   lr_at=(lambda k: base_lr * lr_factor(k, epochs * n_batches, schedule)) if scheduled else None,
                   after=after)
    done = len(losses)
    passes = passes_of(done, n_batches)
    trainer.sync_weights()
    return {"sft_loss_first": losses[0] if losses else 0.0, "sft_loss_last": losses[-1] if losses else 0.0,
            "sft_samples": float(len(samples)), "sft_turns": float(sum(row_turns(r) for r in samples)),
            "sft_passes": float(passes)}


def adopt_warm_start(trainer: "Run") -> dict[str, float]:
    """``sft.warm_start``: the trainer already loaded that folder (its ``model_dir``) in place of model.name's.
    A copy becomes this run's ``warm_start`` so the KL reference and ``agentrl eval --model RUN/warm_start``
    find it as they would a warm start made here, and the run folder still holds everything it started from."""
    folder = trainer.model_dir
    if trainer.is_main and folder.resolve() != (trainer.out_dir / "warm_start").resolve():
        shutil.copytree(folder, trainer.out_dir / "warm_start", dirs_exist_ok=True)
    dist.barrier()
    trainer.echo(f"warm start: {folder} (no demonstrations, no SFT)")
    return {"sft_warm_start_loaded": 1.0}


def warm_start(trainer: "Run", cfg: Any) -> dict[str, float]:
    """The SFT warm start of an RL run (``cfg.sft``, ``cfg`` a ``RecipeCfg``): none unless ``sft.enabled``;
    the folder of ``sft.warm_start`` adopted as is; else SFT on expert demonstrations, with early stopping on
    greedy success (``sft.max_epochs``, ``select_*``), a cooldown, the optimizer reset, and the SFT-only
    policy exported as the run's ``warm_start``."""
    from agentrl.learner.lr import lr_state, restore_lr
    from agentrl.learner.optim_state import reset_optimizer_state

    s = cfg.sft
    if s.warm_start:
        return adopt_warm_start(trainer)
    if not s.enabled:
        return {}
    samples, expert_success = expert_samples(trainer, s.demos)
    scores: list[float] = []
    at: list[float] = []  # the passes made at each reading
    best_dir = trainer.out_dir / "sft_best"
    keep_best = s.select_keep == "best" and not s.target_success

    def rising(passes: float) -> bool:
        """After ``passes`` passes (>= sft.epochs; fractional with sft.select_every < 1): go on unless
        greedy success on the selection tasks has not beaten the best for ``select_patience`` readings
        in a row (with ``sft.target_success``: while it is below the target)."""
        won = trainer.evaluate(s.select_tasks, 1, s.select_split, temperature=0.0)["eval/success"]
        if keep_best and won > max(scores, default=-1.0):
            trainer.engine.save(best_dir)  # early stopping: the warm start unless a later pass beats it
        scores.append(won)
        at.append(passes)
        go_on = won < s.target_success if s.target_success else still_rising(scores, s.select_patience)
        trainer.echo(f"sft pass {passes:g}: greedy success {won:.3f} on {s.select_tasks} {s.select_split} "
                     f"tasks, {'going on' if go_on else 'stopping'}")
        return go_on

    # fit_sft asks `rising` only when sft.max_epochs > sft.epochs
    stats = fit_sft(trainer, samples, s.epochs, s.batch_size, s.lr, s.schedule, s.group_by_length,
                    max_epochs=s.max_epochs, keep_going=rising, check_every=s.select_every)
    stats["expert_success"] = expert_success
    for passes, won in zip(at, scores):
        stats[f"sft_select_success/pass{passes:g}"] = won
    if scores:
        best = scores.index(max(scores))
        if keep_best and best < len(scores) - 1:
            # the saved optimizer state carries SFT's lr: RL keeps its own
            keep = lr_state(trainer.engine)
            trainer.engine.load(best_dir)
            restore_lr(trainer.engine, keep)
            trainer.sync_weights()
            trainer.echo(f"sft: the warm start is pass {at[best]:g} (best reading {scores[best]:.3f})")
        stats["sft_warm_start_pass"] = at[best] if keep_best else at[-1]
        dist.barrier()  # every rank has read it
        if trainer.is_main:
            shutil.rmtree(best_dir, ignore_errors=True)
    if s.cooldown:
        cool = fit_sft(trainer, samples, s.cooldown, s.batch_size, s.lr, "linear", s.group_by_length,
                       stage="cooldown")
        stats |= {"sft_cooldown_passes": cool["sft_passes"], "sft_loss_last": cool["sft_loss_last"]}
    if s.reset_optimizer:
        reset_optimizer_state(trainer.engine)
    # The SFT-only policy, kept next to the checkpoints: RL's before/after can then be measured with
    # any evaluation (`agentrl eval --model RUN/warm_start`), not only the run's own.
    trainer.engine.export_weights(trainer.out_dir / "warm_start")
    if not cfg.algo.critic_path and hasattr(trainer.engine, "critic_from_policy"):
        trainer.engine.critic_from_policy()  # a separate critic starts from the policy RL starts from
    return stats
