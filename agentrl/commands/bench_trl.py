"""`agentrl bench trl`: a GRPO training step of agentrl beside TRL's ``GRPOTrainer`` on the same work.

The same model (``--model``, default tiny), the same single-turn task (the ``bandit`` env's train split: one
pull, rewarded 1 for the arm with the higher expected reward, ``FORMAT_PENALTY`` without a parsable
``<answer>``, as agentrl's GRPO recipe rewards it), the same batch (``--prompts`` x ``--generations``
completions of at most ``--max-new-tokens``, temperature 1, top-p 1, no top-k), one optimizer step per batch
(no mini-batches, one epoch, no old-log-prob pass), PPO clip 0.2, token-mean loss, no KL term (beta 0), the
same entropy bonus (so that agentrl never skips an update whose advantages are all zero: TRL never skips),
AdamW at the same constant lr, gradient clip 1.0, the same precision and torch threads, activation
checkpointing off on both (TRL's GRPOConfig turns it on by default; ``--checkpointing``: on for both). TRL samples the
prompts agentrl's rollout engine renders (token for token; checked), its reward function is agentrl's env
and parser (``bandit_reward``; tests/test_bench_trl.py checks it against the rollout engine's episodes).

Each side runs in a process of its own (``python -m agentrl.commands.bench_trl SIDE``), so its peak resident
memory is its own (``os.wait4``), in alternating order (A B, B A, ...) for ``--repeats`` rounds; each run
takes one warm-up step and ``--steps`` timed ones. Printed: median seconds a step, peak RSS, the ratio, the
settings of both sides and the differences that remain. ``--quick``: 1 round, 1 timed step, 2 x 2.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ENV = "bandit"
FORMAT_PENALTY = -0.1  # rollout.format_penalty's default (RAGEN's)
ENTROPY_COEF = 1e-3
CLIP = 0.2
INSTALL = "pip install 'agentrl[trl]' -c constraints.txt (trl==1.16.0)"
# what neither side's settings can make equal: part of what is compared
DIFFERENCES = [
    "generation: agentrl's embedded generator (the learner's own module; its decode loop with a KV cache, "
    "chunked prefill, last-position logits) vs TRL's HF model.generate on the training model (left-padded batch)",
    "prompts: agentrl's task sampler and TRL's shuffled RepeatSampler draw different bandit tasks of the same "
    "200 (172-190 tokens with the tiny model's tokenizer)",
    "sampled tokens differ (each side's own random stream), so completion lengths may differ: both are printed",
    "agentrl's learner cuts the batch into micro-batches of 16384 padded tokens (one here); TRL forwards the "
    "batch's rows at once, padded to the longest",
    "log-probs: TRL 1.16 always projects through its fused LM head in tiles (trl/kernels/chunked_logprob.py, "
    "no setting turns it off); agentrl projects a micro-batch's generated positions at once (optim.logits_chunk 0)",
    "agentrl's step time is its trainer's time_step_s (collect + learn); TRL's from on_step_begin to on_step_end "
    "(generate, reward, forward, backward, optimizer step); both leave out logging; agentrl writes a checkpoint "
    "after its last step (untimed, inside its peak RSS), TRL saves none",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    # --quick (bench_async's flag): 1 round, 1 timed step, 2 prompts x 2 completions of at most 16 tokens
    p.add_argument("--prompts", type=int, default=8, help="trl: prompts a step (default 8)")
    p.add_argument("--generations", type=int, default=4, help="trl: completions a prompt (default 4)")
    p.add_argument("--lr", type=float, default=1e-5, help="trl: AdamW's constant learning rate (default 1e-5)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="trl: fp32, or bf16 autocast over fp32 weights on both sides (default fp32)")


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The shared settings of one comparison (what both children read)."""
    quick = args.quick
    return dict(model=args.model, prompts=2 if quick else args.prompts, generations=2 if quick else args.generations,
                max_new_tokens=min(args.max_new_tokens, 16) if quick else args.max_new_tokens, lr=args.lr,
                precision=args.precision, checkpointing=args.checkpointing, threads=args.threads,
                steps=1 if quick else (args.steps or 3), repeats=1 if quick else (args.repeats or 3))


# ----- the task, as both sides see it ----------------------------------------------------------------------

def bandit_prompts(tok: Any) -> list[tuple[str, list[int]]]:
    """(task id, prompt ids) of every train task: the first-turn prompt agentrl's rollout engine renders."""
    from agentrl.envs import make
    from agentrl.rollout.episode import RolloutConfig, first_prompt_ids

    env, cfg = make(ENV), RolloutConfig()
    out = []
    for task in env.tasks("train"):
        obs, info = env.reset(task.task_id, 0)
        out.append((task.task_id, first_prompt_ids(tok, cfg, env.prompt_spec(), env.instruction(), obs, [], 0,
                                                   info.get("admissible_actions") if cfg.show_admissible else None)))
    return out


def bandit_reward(env: Any, task_id: str, text: str, format_penalty: float = FORMAT_PENALTY) -> float:
    """What agentrl's GRPO recipe (``algo.reward: success``) rewards ``text`` with as the one turn of an episode
    of ``task_id``: the format penalty without a valid answer, else 1 when the env says the pull won."""
    from agentrl.rollout.parsing import parse_turn

    _, info = env.reset(task_id, 0)
    spec = env.prompt_spec()
    parsed = parse_turn(text, spec.answer_tag, spec.max_actions_per_turn, spec.action_separator, False,
                        info.get("admissible_actions"))
    if not parsed.valid:
        return format_penalty
    *_, step_info = env.step(parsed.actions[0])
    return float(bool(step_info.get("won")))


# ----- the two sides (each in its own process) -------------------------------------------------------------

def agentrl_overrides(s: dict[str, Any], out_dir: str) -> list[str]:
    # model.autocast stays at its default ("": fp32) unless bf16 is asked for
    return [f"model.name={s['model']}", *(["model.autocast=bf16"] if s["precision"] == "bf16" else []),
            f"model.gradient_checkpointing={str(s['checkpointing']).lower()}",
            "sft.enabled=false", "eval.tasks=0", f"rollout.groups={s['prompts']}",
            f"rollout.group_size={s['generations']}", f"rollout.slots={s['prompts'] * s['generations']}",
            "rollout.max_turns=1", f"rollout.max_new_tokens={s['max_new_tokens']}", "rollout.temperature=1.0",
            "rollout.top_p=1.0", f"rollout.format_penalty={FORMAT_PENALTY}", "rollout.fill_groups=0",
            "algo.estimator=grpo", "algo.reward=success", "algo.filters=[dropped]", "algo.mini_batches=1",
            "algo.ppo_epochs=1", "algo.turn_weight=uniform", "algo.agg=token-mean", "algo.kl=none",
            "algo.kl_coef=0.0", f"algo.eps_low={CLIP}", f"algo.eps_high={CLIP}", f"algo.entropy_coef={ENTROPY_COEF}",
            "algo.old_logprobs=sampler", "algo.mismatch=none", f"optim.lr={s['lr']}", "optim.schedule=constant",
            "optim.warmup_steps=0", "optim.weight_decay=0.0", "optim.grad_clip=1.0",
            f"trainer.steps={s['steps'] + 1}", f"trainer.out_dir={out_dir}", "trainer.tensorboard=false",
            "trainer.progress=false", "trainer.checkpoint_every=1000000"]


def run_agentrl(s: dict[str, Any], tmp: str) -> dict[str, Any]:
    from agentrl.config_loader import load_config
    from agentrl.metrics import read_metrics
    from agentrl.trainer import Trainer

    cfg = load_config("grpo", env=ENV, overrides=agentrl_overrides(s, f"{tmp}/run"))
    trainer = Trainer.from_config(cfg)
    try:
        trainer.train()
        rows = read_metrics(trainer.out_dir)[1:]  # step 0 logs no work
    finally:
        trainer.close()
    return dict(step_s=[r["time_step_s"] for r in rows], generate_s=[r.get("time_generate_s", 0.0) for r in rows],
                completion_tokens=[r.get("generated_tokens", 0.0) for r in rows])


def trl_config(s: dict[str, Any], out_dir: str) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=s["prompts"] * s["generations"],
        num_generations=s["generations"], gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        max_completion_length=s["max_new_tokens"], temperature=1.0, top_p=1.0, top_k=0, learning_rate=s["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=CLIP,
        loss_type="dapo", scale_rewards="group", entropy_coef=ENTROPY_COEF, mask_truncated_completions=False,
        max_steps=s["steps"] + 1, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        bf16=s["precision"] == "bf16", fp16=False, gradient_checkpointing=s["checkpointing"], seed=0,
        dataloader_num_workers=0, disable_tqdm=True, log_completions=False, remove_unused_columns=False)


def run_trl(s: dict[str, Any], tmp: str) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from agentrl.envs import make
    from agentrl.learner.models import stop_token_ids
    from agentrl.model_zoo import resolve_model

    folder = resolve_model(s["model"])
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    # stop where agentrl's generator stops (eos and the chat template's end of message)
    model.generation_config.eos_token_id = stop_token_ids(tok, model.config)
    prompts = bandit_prompts(tok)
    texts = [tok.decode(ids) for _, ids in prompts]
    same_ids = all(tok(text=t)["input_ids"] == ids for t, (_, ids) in zip(texts, prompts))
    data = Dataset.from_dict({"prompt": texts, "task_id": [t for t, _ in prompts]})
    env = make(ENV)

    def reward(prompts: list[str], completions: list[str], task_id: list[str], **_: Any) -> list[float]:
        return [bandit_reward(env, t, c) for t, c in zip(task_id, completions)]

    times: dict[str, list[float]] = dict(begin=[], end=[], generate=[])
    generate = model.generate

    def timed_generate(*a: Any, **k: Any) -> Any:  # TRL generates with the model it trains (no wrapper on CPU)
        t = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            times["generate"].append(time.perf_counter() - t)

    model.generate = timed_generate
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            times["begin"].append(time.perf_counter())

        def on_step_end(self, *a: Any, **k: Any) -> None:
            times["end"].append(time.perf_counter())

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict[str, float] | None = None,
                   **k: Any) -> None:
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"] * s["prompts"] * s["generations"])

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=trl_config(s, f"{tmp}/trl"), train_dataset=data,
                          processing_class=tok, callbacks=[Clock()])
    trainer.train()
    return dict(step_s=[e - b for b, e in zip(times["begin"], times["end"])], generate_s=times["generate"],
                completion_tokens=lengths,
                prompt_ids_match=same_ids)


def _child(argv: list[str]) -> None:
    """One side's run: ``SIDE SETTINGS_JSON OUT_JSON``."""
    side, s, out = argv[0], json.loads(argv[1]), Path(argv[2])
    import torch

    torch.set_num_threads(s["threads"])
    with tempfile.TemporaryDirectory() as tmp:
        got = (run_agentrl if side == "agentrl" else run_trl)(s, tmp)
    out.write_text(json.dumps(got))


# ----- the comparison ---------------------------------------------------------------------------------------

def trl_missing() -> str:
    """Why TRL cannot run here, in a line ('' when it can)."""
    try:
        import trl
    except ImportError:
        return f"agentrl bench trl needs TRL: {INSTALL}"
    if trl.__version__ != "1.16.0":
        print(f"note: TRL {trl.__version__} installed; the comparison was written against 1.16.0", file=sys.stderr)
    return ""


def one_run(side: str, s: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """A side's run in its own process: its figures, its peak RSS (MiB) and its wall time."""
    out, log = tmp / f"{side}.json", tmp / f"{side}.log"
    import agentrl

    # the child imports the agentrl this process runs (a checkout's, not only an installed one)
    root = str(Path(agentrl.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS=str(s["threads"]), TOKENIZERS_PARALLELISM="false", PYTHONPATH=path,
               WANDB_MODE="disabled", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "agentrl.commands.bench_trl", side, json.dumps(s), str(out)],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-15:]
        raise SystemExit("\n".join(tail) + f"\nerror: bench trl: the {side} side exited {proc.returncode} "
                         "(its last lines above)")
    got = json.loads(out.read_text())
    kb = usage.ru_maxrss  # KiB on Linux: the child's peak, or its largest waited-for descendant's
    got.update(peak_rss_mb=kb / 1024 if sys.platform != "darwin" else kb / 2**20, wall_s=time.perf_counter() - t)
    return got


def run(args: argparse.Namespace) -> int:
    why = trl_missing()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    import trl

    s = settings(args)
    load = [os.getloadavg()[0]]
    runs: dict[str, list[dict[str, Any]]] = dict(agentrl=[], trl=[])
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(s["repeats"]):
            for side in (("agentrl", "trl") if k % 2 == 0 else ("trl", "agentrl")):
                got = one_run(side, s, Path(tmp))
                runs[side].append(got)
                load.append(os.getloadavg()[0])
                timed = got["step_s"][1:]
                print(f"  round {k + 1} {side:7s}: {statistics.median(timed):6.2f} s a step (median of "
                      f"{len(timed)} after a warm-up of {got['step_s'][0]:.2f} s; generating "
                      f"{statistics.median(got['generate_s'][1:]):.2f} s), peak RSS "
                      f"{got['peak_rss_mb']:6.0f} MB, process {got['wall_s']:.0f} s", flush=True)
    fig: dict[str, Any] = dict(settings=s, trl_version=trl.__version__, load_1min=load)
    for side, rs in runs.items():
        steps = [x for r in rs for x in r["step_s"][1:]]
        tokens = [x for r in rs for x in r["completion_tokens"][1:]]
        fig[side] = dict(step_s=statistics.median(steps), steps=[round(x, 3) for x in steps],
                         generate_s=statistics.median(x for r in rs for x in r["generate_s"][1:]),
                         peak_rss_runs=[round(r["peak_rss_mb"]) for r in rs],
                         peak_rss_mb=statistics.median(r["peak_rss_mb"] for r in rs),
                         completion_tokens_per_step=statistics.mean(tokens) if tokens else 0.0)
    fig["trl_prompt_ids_match"] = all(r.get("prompt_ids_match") for r in runs["trl"])
    fig["speedup"] = fig["trl"]["step_s"] / fig["agentrl"]["step_s"]
    # each round's own ratio: the machine's load drifts between rounds more than within one
    fig["round_speedups"] = [statistics.median(t["step_s"][1:]) / statistics.median(a["step_s"][1:])
                             for a, t in zip(runs["agentrl"], runs["trl"])]
    fig["rss_ratio"] = fig["trl"]["peak_rss_mb"] / fig["agentrl"]["peak_rss_mb"]
    a, b = fig["agentrl"], fig["trl"]
    print(f"model {s['model']}, env {ENV}, {s['prompts']} prompts x {s['generations']} completions of <= "
          f"{s['max_new_tokens']} tokens, lr {s['lr']:g}, {s['precision']}, activation checkpointing "
          f"{'on' if s['checkpointing'] else 'off'}, {s['threads']} torch thread(s), "
          f"{s['repeats']} alternating round(s) x {s['steps']} timed step(s); TRL {trl.__version__}")
    for name, x in (("agentrl", a), ("TRL", b)):
        print(f"  {name:7s} {x['step_s']:6.2f} s a step (generating {x['generate_s']:.2f} s, the rest "
              f"{x['step_s'] - x['generate_s']:.2f} s), peak RSS {x['peak_rss_mb']:6.0f} MB, "
              f"{x['completion_tokens_per_step']:.0f} completion tokens a step")
    print(f"  TRL / agentrl: step time {fig['speedup']:.2f}x (goal >= 3x; rounds "
          f"{', '.join(f'{x:.2f}' for x in fig['round_speedups'])}), peak RSS {fig['rss_ratio']:.2f}x "
          f"(goal > 1); TRL's prompt ids are agentrl's: {fig['trl_prompt_ids_match']}; "
          f"1-minute load {min(load):.1f} to {max(load):.1f}")
    print("  agentrl: agentrl train grpo --env bandit " + " ".join(map(shlex.quote, agentrl_overrides(s, "OUT"))))
    with warnings.catch_warnings():  # transformers' deprecation notes on TrainingArguments' own fields
        warnings.simplefilter("ignore")
        cfg = trl_config(s, "OUT")
    keys = ["per_device_train_batch_size", "num_generations", "gradient_accumulation_steps", "steps_per_generation",
            "num_iterations", "max_completion_length", "temperature", "top_p", "top_k", "learning_rate",
            "lr_scheduler_type", "weight_decay", "max_grad_norm", "beta", "epsilon", "loss_type", "scale_rewards",
            "entropy_coef", "max_steps", "bf16", "gradient_checkpointing", "use_cpu", "seed"]
    print("  TRL: GRPOConfig(" + ", ".join(f"{k}={getattr(cfg, k)!r}" for k in keys) + ")")
    print("  not the same on both sides:")
    for d in DIFFERENCES:
        print(f"    - {d}")
    fig["differences"] = DIFFERENCES
    print(json.dumps({k: fig[k] for k in ("speedup", "rss_ratio")} | {
        "agentrl_step_s": a["step_s"], "trl_step_s": b["step_s"], "agentrl_peak_rss_mb": a["peak_rss_mb"],
        "trl_peak_rss_mb": b["peak_rss_mb"]}))
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))
    return 0


if __name__ == "__main__":
    _child(sys.argv[1:])
