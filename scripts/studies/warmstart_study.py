"""Warm-start study: held-out success after each SFT pass, per task category, in one process.

    .venv/bin/python scripts/studies/warmstart_study.py crps --env alfworld --passes 4 --eval-tasks 60 \\
        -o sft.demos=600 rollout.max_turns=30

Plays the recipe's expert demonstrations once, then alternates one SFT pass with a greedy evaluation
(``eval.split``, ``eval.tasks``), printing one JSON line per pass; ``--save DIR`` keeps the last model.
``--sampled`` also evaluates at the rollout temperature (what RL's groups start from). Each pass is one
``fit_sft`` call that shuffles with the run's seed, so P passes here are P constant-lr passes, not bit for
bit the same as one run with ``sft.epochs=P``.
"""
from __future__ import annotations

import argparse
import json
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("--env", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--passes", type=int, default=4, help="SFT passes; 0: only evaluate --model as it is")
    ap.add_argument("--eval-tasks", type=int, default=0, help="held-out tasks per evaluation (0: eval.tasks)")
    ap.add_argument("--show", type=int, default=0, help="print the actions of this many held-out episodes per pass")
    ap.add_argument("--sampled", action="store_true", help="also evaluate at the rollout temperature")
    ap.add_argument("--step-acc", type=int, default=0,
                    help="also the greedy policy's agreement with the expert on every state of this many held-out "
                         "expert episodes (eval.split, no noise), overall and by the expert's action verb")
    ap.add_argument("--fit-acc", type=int, default=0,
                    help="also the greedy policy's agreement with the labels of this many SFT samples (drawn once): "
                         "how well it fits its own training data, against --step-acc's held-out states")
    ap.add_argument("--save", default="", help="folder for the model after the last pass")
    ap.add_argument("-o", "--overrides", nargs="*", default=[])
    a = ap.parse_args()

    from agentrl import Trainer, load_config
    from agentrl.sft import expert_samples, fit_sft

    overrides = [f"trainer.seed={a.seed}", "trainer.out_dir=/tmp/warmstart-study-{env}-s{seed}",
                 "trainer.tensorboard=false", *a.overrides]
    cfg = load_config(a.recipe, env=a.env, overrides=overrides, model=a.model)
    trainer = Trainer.from_config(cfg)
    try:
        t0 = time.perf_counter()
        samples: list = []
        if a.passes:
            samples, expert_success = expert_samples(trainer, cfg.sft.demos)
            print(json.dumps(dict(demos=cfg.sft.demos, samples=len(samples), expert_success=expert_success,
                                  demo_s=round(time.perf_counter() - t0, 1))), flush=True)
        held_out = _held_out_states(trainer, a.step_acc) if a.step_acc else []
        fit_states = _sample_states(trainer, random.Random(a.seed).sample(samples, min(a.fit_acc, len(samples))))
        for p in range(1, a.passes + 1) or [0]:  # pass 0: the model as it is
            t0 = time.perf_counter()
            stats = (fit_sft(trainer, samples, 1, cfg.sft.batch_size, cfg.sft.lr, by_length=cfg.sft.group_by_length)
                     if p else {})
            t_sft = time.perf_counter() - t0
            res = trainer.evaluate(n_tasks=a.eval_tasks or None)
            if a.show:  # what the policy does on the first held-out tasks
                from agentrl.rollout.engine import Start

                split = cfg.eval.split
                for ep in trainer.rollout([Start(t, 1000 + i, f"show:{t}") for i, t in enumerate(
                        trainer.task_ids(split)[:a.show])], temperature=0.0):
                    print(f"  {ep.task_id} won={ep.won}: {ep.instruction} :: " + " ; ".join(
                        x for t in ep.turns for x in (t.actions or ["<invalid>"])), flush=True)
            if a.sampled:  # the rollouts RL starts from sample at the rollout temperature
                smp = trainer.evaluate(n_tasks=a.eval_tasks or None, temperature=cfg.rollout.temperature)
                res["eval/sampled_success"] = smp["eval/success"]
            if held_out:
                res.update(_step_accuracy(trainer, held_out))
            if fit_states:
                res.update({"fit_" + k: v for k, v in _step_accuracy(trainer, fit_states).items()})
            print(json.dumps(dict(sft_pass=p, sft_s=round(t_sft, 1), eval_s=round(time.perf_counter() - t0 - t_sft, 1),
                                  loss=round(stats["sft_loss_last"], 3) if stats else None,
                                  **{k: round(v, 3) for k, v in res.items()
                                     if k.startswith(("eval/success", "eval/sampled", "step_acc", "fit_step_acc"))
                                     or k in ("eval/turns_per_episode", "eval/valid_format")})), flush=True)
        if a.save:
            trainer.engine.export_weights(a.save)
    finally:
        trainer.close()


def _held_out_states(trainer, n: int) -> list:
    """(prompt ids, expert action) for every state of ``n`` noise-free expert episodes of eval.split."""
    from agentrl.sft import expert_samples

    noise, trainer.cfg.sft.noise = trainer.cfg.sft.noise, 0.0
    try:
        samples, _ = expert_samples(trainer, n, split=trainer.cfg.eval.split, episodes=False)  # a row a state
    finally:
        trainer.cfg.sft.noise = noise
    return _sample_states(trainer, samples)


def _sample_states(trainer, samples: list) -> list:
    """(prompt ids, label text) of turn samples."""
    out = []
    for s in samples:
        first = s.loss_mask.index(1)
        out.append((s.ids[:first], trainer.tokenizer.decode(s.ids[first:], skip_special_tokens=True)))
    return out


def _step_accuracy(trainer, states: list) -> dict[str, float]:
    """How often the greedy policy's action equals the expert's, overall and per expert verb."""
    import re

    from agentrl.types import SamplingParams

    cfg = trainer.rollout_config(temperature=0.0)
    outs = trainer.generate([p for p, _ in states], SamplingParams(
        temperature=0.0, max_new_tokens=cfg.sampling.max_new_tokens, stop=cfg.sampling.stop))

    def action(text: str) -> str:
        m = re.search(r"<action>(.*?)(</action>|$)", text, re.S)
        return (m.group(1) if m else text).strip()

    hits: dict[str, list[int]] = {}
    for (_, label), out in zip(states, outs):
        want = action(label)
        verb = want.split(" ")[0] if want else "?"
        hits.setdefault(verb, []).append(int(action(out.text) == want))
    allh = [h for v in hits.values() for h in v]
    res = {"step_acc": sum(allh) / max(1, len(allh)), "step_states": float(len(allh))}
    for v, h in sorted(hits.items()):
        if len(h) >= 10:
            res[f"step_acc/{v}"], res[f"step_acc_n/{v}"] = sum(h) / len(h), float(len(h))
    return res


if __name__ == "__main__":
    main()
