"""`agentrl train`, `agentrl eval` and `agentrl plot`."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from agentrl.types import Episode


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", help="env name (default: the recipe's)")
    p.add_argument("--model", help="tiny | tiny:KEY=N,... (sized, e.g. tiny:hidden_size=256) | smollm2 | "
                                   "path to an HF model folder (default: the recipe's)")
    p.add_argument("--seed", type=int, help="trainer.seed")
    p.add_argument("--out", help="trainer.out_dir (default runs/{recipe}-{env}-s{seed})")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.max_turns=5 algo.kl_coef=0.001")


def add_parser(sub: Any) -> None:
    t = sub.add_parser("train", help="train with a recipe", description="Train a policy with a recipe YAML "
                       "(recipes/NAME.yaml or a path). Resumes from the run folder's last checkpoint.",
                       epilog="example: agentrl train grpo --env sokoban rollout.group_size=8 trainer.steps=50")
    t.add_argument("recipe", nargs="?", default="grpo", help="recipe name or YAML path (default grpo)")
    _common(t)
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    t.add_argument("--dry-run", action="store_true", help="print the launch plan (per node and GPU: learner ranks, "
                   "vLLM servers and their commands, NCCL groups, memory estimates) and exit; no GPU needed")
    t.add_argument("--nodes", type=int, help="--dry-run: nodes of the plan (default 1)")
    t.add_argument("--gpus-per-node", type=int, help="--dry-run: GPUs per node (default: this machine's)")
    t.add_argument("--gpu-memory-gib", type=float, help="--dry-run: memory of one GPU, GiB (default: this "
                   "machine's GPU, else 74.5: an 80 GB card)")
    t.add_argument("--print-sources", action="store_true",
                   help="print every key's value with where it came from (recipe, demo overlay, model overlay, "
                        "user, default) and exit")
    t.add_argument("--changed-only", action="store_true", help="--print-sources: leave out the keys at their "
                   "default")
    t.set_defaults(func=run_train)
    e = sub.add_parser("eval", help="evaluate a model or checkpoint: success, pass@k, per category",
                       description="Evaluate --model (a checkpoint's model folder, a model spec) on --tasks tasks of "
                                   "--split: prints success, pass@k and per-category success; writes the run folder's "
                                   "eval_episodes.jsonl and rollouts/eval.jsonl.gz (agentrl view, agentrl show)")
    e.add_argument("--split", default="valid", choices=["train", "valid", "test"],
                   help="the env split whose tasks are evaluated (default valid)")
    e.add_argument("--tasks", type=int, default=32, help="the split's first N tasks (default 32)")
    e.add_argument("--samples", type=int, default=1, help="samples per task (pass@k for k <= samples)")
    _common(e)
    e.set_defaults(func=run_eval)
    pl = sub.add_parser("plot", help="PNG learning curves and diagnostics of a run folder")
    pl.add_argument("run_dir", nargs="+")
    pl.add_argument("--out", help="output PNG (default RUN_DIR/curves.png)")
    pl.add_argument("--compare", action="store_true",
                    help="one curve per method (run folders NAME-sSEED grouped by NAME, mean over seeds), "
                         "against cumulative env steps")
    pl.add_argument("--x", choices=["env_steps", "step"], default="env_steps", help="x axis of --compare")
    pl.set_defaults(func=run_plot)


def _overrides(args: argparse.Namespace) -> list[str]:
    overrides = list(args.overrides or [])
    if args.seed is not None:
        overrides.append(f"trainer.seed={args.seed}")
    if args.out:
        overrides.append(f"trainer.out_dir={args.out}")
    return overrides


def _config(args: argparse.Namespace, recipe: str) -> Any:
    from agentrl.config_loader import load_config

    return load_config(recipe, env=args.env, overrides=_overrides(args), model=args.model)


def _trainer(cfg: Any) -> Any:
    """The run's trainer; ``Trainer.from_config`` runs the preflight checks (device, packages, env, model
    folder) before anything is built, so a machine that cannot run ``cfg`` fails in one line."""
    from agentrl.trainer import Trainer

    return Trainer.from_config(cfg)


def _run_on_every_rank(cfg: Any, work: Callable[[Any], Any]) -> tuple[Any, Any]:
    """Build the trainer and run ``work`` on it, then close it. Launched on several ranks, an error on one
    stops every rank at once (the trainer's guard, ``agentrl.fail_fast``): it prints its traceback here,
    the others exit naming it, and nobody waits at a barrier for it."""
    with _trainer(cfg) as trainer:
        out = work(trainer)
    return trainer, out


def run_train(args: argparse.Namespace) -> int:
    cfg = _config(args, args.recipe)
    if args.print_sources:
        from agentrl.config_loader import config_sources, resolved_values

        values = resolved_values(cfg)
        for key, where in config_sources(args.recipe, args.env, _overrides(args), args.model,
                                         defaults=not args.changed_only).items():
            print(f"{key}: {values[key]!r}  # {where}")
        return 0
    from agentrl.preflight import preflight

    if args.print_config:
        import yaml

        preflight(cfg)  # what the run would refuse here, refused in the same line
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0
    if args.dry_run:
        from agentrl.commands.plan import run as plan

        preflight(cfg, planned_ranks=_planned_ranks(cfg, args.nodes, args.gpus_per_node))
        return plan(cfg, args.nodes, args.gpus_per_node, args.gpu_memory_gib)
    trainer, final = _run_on_every_rank(cfg, _train)
    if trainer.is_main:
        print(json.dumps({"run": str(cfg.out_dir), **final}, indent=1))
    return 0


def _planned_ranks(cfg: Any, nodes: int | None, gpus_per_node: int | None) -> int:
    """The learner ranks of the launch plan (``--nodes`` x ``--gpus-per-node``, this machine's GPUs by
    default; 1 when there are none: the plan then asks for the shape)."""
    import torch

    from agentrl.generation.layout import place

    gpus = gpus_per_node or (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if not gpus or (nodes or 1) < 1:
        return 1
    return max(1, place(cfg.trainer, cfg.vllm, nodes or 1, gpus).learner_ranks)


def _train(trainer: Any) -> Any:
    """``trainer.train()``, a SIGTERM meanwhile saying where the run stopped."""
    undo = _say_where_sigterm_stops(trainer)
    try:
        return trainer.train()
    finally:
        undo()


def _say_where_sigterm_stops(trainer: Any) -> Callable[[], None]:
    """Until the returned undo is called: SIGTERM, which ended a run without a word, says at which step it
    stopped and how to resume, then exits 143 at once as before (nothing is saved; the kept checkpoints are
    intact). A thread reading the signal's wakeup fd does it, so a main thread held in C code (a collective,
    a long op) does not delay the stop. Rank 0 only, from the main thread (Python's signal rule)."""
    import os
    import signal
    import sys
    import threading

    from agentrl import checkpoint as ckpt
    from agentrl import hard_exit

    if not trainer.is_main or threading.current_thread() is not threading.main_thread():
        return lambda: None
    once = threading.Lock()

    def stop(*_: Any) -> None:
        if not once.acquire(blocking=False):
            return
        try:
            target, _missing = ckpt.link_target(trainer.out_dir)
            last = f"the last checkpoint is {target.name}" if target is not None else "there is no checkpoint yet"
            print(f"stopped by SIGTERM in step {trainer.step + 1} of {trainer.out_dir} ({last}): run the same command "
                  "to resume", file=sys.stderr, flush=True)
        finally:
            hard_exit.exit_now(128 + signal.SIGTERM)  # the servers stopped first

    def watch() -> None:
        while (got := os.read(r, 64)) and 0 not in got:  # a 0 byte: undone
            if signal.SIGTERM in got:
                stop()
        os.close(r)
        os.close(w)

    r, w = os.pipe()
    os.set_blocking(w, False)
    old_handler, old_fd = signal.signal(signal.SIGTERM, stop), signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    threading.Thread(target=watch, daemon=True, name="sigterm").start()

    def undo() -> None:
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGTERM, old_handler)
        os.write(w, b"\0")

    return undo


def run_eval(args: argparse.Namespace) -> int:
    from agentrl.config import ConfigError

    for flag, value in (("--tasks", args.tasks), ("--samples", args.samples)):
        if value < 1:
            raise ConfigError(f"bad value for '{flag}': {value}; allowed: 1 or more")
    overrides = list(args.overrides or []) + [f"eval.split={args.split}", f"eval.tasks={args.tasks}",
                                              f"eval.samples={args.samples}"]
    args.overrides = overrides
    cfg = _config(args, "eval")
    # pass@1, 2, 4, ... up to eval.samples (the ladder lives in Trainer.evaluate)
    trainer, res = _run_on_every_rank(cfg, lambda t: t.evaluate())
    trainer.records.write(trainer.step)  # RUN/rollouts/eval.jsonl.gz: what `agentrl view` and `show` read
    if trainer.is_main:
        from agentrl.io_atomic import open_in_folder

        # per-episode results, for paired comparisons; never through a link leaving the run folder
        with open_in_folder(cfg.out_dir / "eval_episodes.jsonl", "w") as f:
            for ep in trainer.eval_episodes:
                f.write(json.dumps(episode_row(ep)) + "\n")
        print(json.dumps(res, indent=1))
    return 0


def episode_row(ep: Episode) -> dict[str, Any]:
    """One evaluated episode: its outcome, and what the policy did each turn (the env actions it sent,
    its raw text where none parsed) with the turns that left the env's state unchanged, so a reader can
    see where a policy loops."""
    return dict(task_id=ep.task_id, won=bool(ep.won), reward=ep.total_reward, turns=len(ep.turns),
                actions=[t.action_text if t.actions else t.text for t in ep.turns],
                ineffective=[i for i, t in enumerate(ep.turns) if t.info.get("ineffective")])


def run_plot(args: argparse.Namespace) -> int:
    from agentrl.plot import plot_compare, plot_runs

    out = Path(args.out) if args.out else Path(args.run_dir[0]) / ("compare.png" if args.compare else "curves.png")
    if args.compare:
        plot_compare([Path(d) for d in args.run_dir], out, args.x)
    else:
        plot_runs([Path(d) for d in args.run_dir], out)
    print(f"wrote {out}")
    return 0
