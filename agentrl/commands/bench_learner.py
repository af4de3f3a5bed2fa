"""`agentrl bench learner`: the learner's time and resident memory over optimizer steps whose batches each
have new shapes, as SFT and RL batches do (32 rows of random lengths, cut into micro-batches by the token
budget). Memory must level off after the first steps: under bf16 autocast on CPU, kernel caches keyed by
shape grew by ~80 MB a step until ``import agentrl`` capped them (docs/guides/memory.md).

It also counts the ATen operators one step dispatches (device-independent): on a GPU a small model's
step is bound by launching them, not by arithmetic (docs/studies/gpu.md).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any


def length_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give the shortest and longest row as LO-HI (200-1200)") from None
    if not 17 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: need 17 <= LO <= HI (each row has 16 target tokens)")
    return lo, hi


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--learner-steps", type=int, default=30, help="learner: optimizer steps (default 30)")
    p.add_argument("--lengths", default="200-1200", type=length_range,
                   help="learner: row lengths drawn from LO-HI tokens (default 200-1200)")
    p.add_argument("--autocast", default="bf16", choices=["bf16", "none"], help="learner: bf16 autocast or fp32")
    p.add_argument("--token-budget", type=int, default=16384, help="learner: tokens per micro-batch")
    p.add_argument("--rows", type=int, default=32, help="learner: rows per optimizer step (default 32)")
    p.add_argument("--lora", type=int, default=0, metavar="R", help="learner: LoRA rank R, alpha 2R (default 0: "
                   "full fine-tuning)")
    p.add_argument("--device", default="cpu", help="learner: cpu (default) | cuda | cuda:N")
    p.add_argument("--compile", action="store_true", help="learner: torch.compile the decoder (model.compile)")
    p.add_argument("--checkpointing", action="store_true",
                   help="learner: activation checkpointing (model.gradient_checkpointing)")


def slope(ys: list[float]) -> float:
    """Least-squares change per step: one step's reading moves by tens of MB as the allocator keeps or
    returns a micro-batch's activations, so two readings alone say little."""
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sum((i - mx) ** 2 for i in range(n))


def peak_rss_mb() -> float:
    import resource
    import sys

    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return kb / 2**20 if sys.platform == "darwin" else kb / 2**10


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def count_ops(step: Any) -> tuple[int, int]:
    """(ATen operators, those called from Python) during one call of ``step``, by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    return len(aten), sum(1 for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))


def run(args: argparse.Namespace) -> int:
    import psutil

    from agentrl.algos.losses import sft_loss
    from agentrl.learner.batch import Sample, collate
    from agentrl.learner.engine import EngineConfig, LoraSettings, TorchEngine
    from agentrl.model_zoo import resolve_model

    lo, hi = args.lengths
    eng = TorchEngine(resolve_model(args.model), EngineConfig(
        token_budget=args.token_budget, autocast="" if args.autocast == "none" else args.autocast,
        lora=LoraSettings(args.lora, 2 * args.lora) if args.lora else None, device=args.device, compile=args.compile,
        gradient_checkpointing=args.checkpointing))
    vocab, rng, proc = eng.model.config.vocab_size, random.Random(0), psutil.Process()

    def loss(mb: Any, out: Any) -> tuple[Any, dict[str, float]]:
        return sft_loss(out["logp"], mb.loss_mask), {}

    def batch() -> Any:
        rows = []
        for _ in range(args.rows):
            n = rng.randint(lo, hi)
            ids = [rng.randrange(vocab) for _ in range(n)]
            rows.append(Sample(ids, [0] * (n - 16) + [1] * 16, [0.0] * n, [1.0] * n))
        return collate(rows, eng.pad_id)

    rss, secs = [], []
    for _ in range(args.learner_steps):
        b = batch()
        t = time.perf_counter()
        eng.step(b, loss)
        sync(args.device)
        secs.append(time.perf_counter() - t)
        rss.append(proc.memory_info().rss / 2**20)
    # one more step, outside the timed ones: forward and backward, then clipping and the update (on CPU
    # these loop over the parameters one tensor at a time; on CUDA torch batches them by default)
    b = batch()
    eng.model.train()
    eng.optimizer.zero_grad(set_to_none=True)
    ops, top_ops = count_ops(lambda: eng.backward(b, loss))
    opt_ops, opt_top = count_ops(eng._clip_and_step)
    first = len(rss) // 3  # the first steps fill the caches and the allocator's pools
    fig = dict(model=args.model, lora=args.lora, device=args.device, rows=args.rows, autocast=args.autocast,
               compile=args.compile, checkpointing=args.checkpointing, first_step_s=secs[0],
               peak_rss_mb=peak_rss_mb(),
               steps=len(rss), lengths=f"{lo}-{hi}", aten_ops_per_step=ops + opt_ops,
               top_level_ops_per_step=top_ops + opt_top, top_level_ops_update=opt_top,
               onednn_cache=os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ""),
               ideep_cache=os.environ.get("LRU_CACHE_CAPACITY", ""), step_s=sum(secs[1:]) / max(1, len(secs) - 1),
               rss_growth_mb_per_step=slope(rss[first:]), rss_mb=[round(x) for x in rss])
    print(f"learner: model {args.model}{f' + LoRA r{args.lora}' if args.lora else ''}"
          f"{' compiled' if args.compile else ''}{' checkpointed' if args.checkpointing else ''} on {args.device}, "
          f"autocast "
          f"{args.autocast}, {len(rss)} steps of {args.rows} rows of {lo}-{hi} tokens, kernel caches "
          f"{fig['onednn_cache'] or 'default'}/{fig['ideep_cache'] or 'default'}")
    print(f"  {top_ops + opt_top} operators dispatched a step ({ops + opt_ops} counting those they call), "
          f"{opt_top} of them by clipping and the optimizer update")
    print(f"  {fig['step_s']:.2f} s a step after the first ({secs[0]:.1f} s); resident {rss[0]:.0f} MB after step 1, "
          f"{rss[-1]:.0f} MB at the end: {fig['rss_growth_mb_per_step']:+.1f} MB a step after step {first + 1} "
          "(goal: under 10; uncapped ~80)")
    print(f"  peak resident {fig['peak_rss_mb']:.0f} MB (the step's activations at their largest: compare "
          "runs with and without --checkpointing)")
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))
    return 0
