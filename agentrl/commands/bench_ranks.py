"""`agentrl bench ranks`: the training loop at 1 rank and at N ranks on the same work (DeepSpeed ZeRO-3).

Each world size is launched with torchrun (``python -m agentrl.commands.bench_ranks`` on every rank). Every rank
builds the trainer from the same recipe overrides and runs ``--steps`` steps after one warm-up step;
rank 0 writes the mean time per step (and its rollout and update parts), the tokens generated per step,
and each rank's share of the parameters that ZeRO-3 leaves it. The parent prints throughput ratios.
Updates are never skipped (a small entropy bonus), so every step has its learner part.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WORK = ["sft.enabled=false", "eval.tasks=0", "rollout.fill_groups=0", "rollout.groups=8", "rollout.group_size=4",
        "rollout.max_turns=4", "algo.entropy_coef=0.001", "algo.filters=[dropped]", "trainer.engine=deepspeed",
        "trainer.tensorboard=false", "trainer.progress=false", "trainer.checkpoint_every=1000000"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2, help="world size compared with 1 (default 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps after one warm-up step (ranks, trl: "
                   "default 3; async: each training run's, default 3 for the overlap, 5 for continuous)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1: one core each)")


def run(args: argparse.Namespace) -> int:
    from agentrl.launch import rank_command

    results = {}
    for world in (1, args.ranks):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "bench.json"
            overrides = WORK + [f"trainer.out_dir={tmp}/run", f"trainer.steps={(args.steps or 3) + 1}"]
            if args.model:
                overrides.append(f"model.name={args.model}")
            cmd = rank_command(world, ["--out", str(out), "--env", args.env, *overrides],
                               module="agentrl.commands.bench_ranks")
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
            env.setdefault("DS_ACCELERATOR", "cpu")
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            results[world] = json.loads(out.read_text())
    one, many = results[1], results[args.ranks]
    fig = dict(ranks=args.ranks, threads_per_rank=args.threads, one=one, many=many,
               step_speedup=one["step_s"] / many["step_s"], rollout_speedup=one["rollout_s"] / many["rollout_s"],
               update_speedup=one["update_s"] / many["update_s"],
               param_share_per_rank=many["partition_numel"] / many["full_numel"])
    print(f"model {one['model']}, env {args.env}, {one['episodes']} episodes a step, {args.steps or 3} timed steps, "
          f"{args.threads} thread(s) per rank")
    for w, r in ((1, one), (args.ranks, many)):
        print(f"  {w} rank(s): {r['step_s']:.2f} s/step (rollout {r['rollout_s']:.2f}, update {r['update_s']:.2f}), "
              f"{r['tokens_per_step'] / r['step_s']:.0f} generated tok/s")
    print(f"  {args.ranks} ranks vs 1: step {fig['step_speedup']:.2f}x, rollout {fig['rollout_speedup']:.2f}x, "
          f"update {fig['update_speedup']:.2f}x faster")
    print(f"  ZeRO-3 parameters per rank: {many['partition_numel']:,} of {many['full_numel']:,} "
          f"({fig['param_share_per_rank']:.2f} of the full model)")
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))
    return 0


def _rank_main(argv: list[str]) -> None:
    """One rank of a timed run (launched by ``run``)."""
    from agentrl.config_loader import load_config
    from agentrl.metrics import read_metrics
    from agentrl.trainer import Trainer

    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--env")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    cfg = load_config("grpo", env=a.env, overrides=a.overrides)
    trainer = Trainer.from_config(cfg)
    try:
        trainer.train()
        rows = read_metrics(trainer.out_dir)[2:]  # step 0 (no work) and step 1 (warm-up: caches, allocators)
        mean = lambda k: sum(r.get(k, 0.0) for r in rows) / len(rows)  # noqa: E731
        eng = trainer.engine
        report = dict(model=cfg.model.name, world=trainer.world, step_s=mean("time_step_s"),
                      update_s=mean("time_learn_s"), rollout_s=mean("time_step_s") - mean("time_learn_s"),
                      tokens_per_step=mean("generated_tokens"),
                      episodes=cfg.rollout.groups * cfg.rollout.group_size,
                      partition_numel=eng.partition_numel(), full_numel=eng.full_numel())
        if trainer.is_main:
            Path(a.out).write_text(json.dumps(report))
    finally:
        trainer.close()


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
