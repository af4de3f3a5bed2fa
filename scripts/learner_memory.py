"""One ZeRO-3 learner rank's peak GPU memory for an optimizer step of T tokens, beside the launch plan's
estimate for the same shape (``agentrl.gpu_memory``, with the terms ``agentrl train --dry-run`` reads from
the same config): what scripts/gpu_check.sh records for a 7B-wide slice.

    python scripts/learner_memory.py --model tiny:hidden_size=3584,... --tokens 2048,4096,8192 [--checkpointing]
    python scripts/learner_memory.py --model ... --tokens ... --plan-only   # any machine: the estimates alone

Each step trains on rows of 1,024 random tokens (the last fifth generated: the plan's R = T/5) in one
micro-batch of T tokens (``optim.token_budget=T``), under configs/deepspeed/zero3.json (bf16). Peak:
``torch.cuda.max_memory_allocated`` over the step, after a warm-up step that allocated Adam's states.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import replace
from pathlib import Path

ROW = 1024  # tokens a row
GENERATED = 0.2  # of each row, the plan's R/T
DS_CONFIG = "configs/deepspeed/zero3.json"


def plan_estimate(model: str, tokens: int, checkpointing: bool) -> dict[str, float]:
    """The plan's learner estimate (GiB) for one rank of ``model`` at a micro-batch of ``tokens``."""
    from agentrl import gpu_memory as gm
    from agentrl.commands.plan import learner_terms, model_config
    from agentrl.config_loader import load_config

    cfg = load_config("grpo", model=model, overrides=[
        "trainer.engine=deepspeed", f"trainer.deepspeed_config={DS_CONFIG}", "trainer.generator=vllm",
        f"optim.token_budget={tokens}", f"model.gradient_checkpointing={str(checkpointing).lower()}"])
    terms = replace(learner_terms(cfg, 1), reference=False, generator_bytes=0)  # the policy's step alone
    est = gm.learner(gm.ModelShape.from_config(model_config(model)), terms, tokens, int(tokens * GENERATED))
    return {k: round(v / gm.GIB, 2) for k, v in dict(states=est.states, working_set=est.working_set,
                                                       activations=est.activations_ckpt if checkpointing else
                                                       est.activations, logits=est.logits, total=est.total).items()}


def batch(tokens: int, vocab: int, pad_id: int, seed: int):
    from agentrl.learner.batch import collate, turn_sample

    rng = random.Random(seed)
    gen = int(ROW * GENERATED)
    rows = []
    for _ in range(max(1, tokens // ROW)):
        ids = [rng.randrange(4, vocab) for _ in range(ROW)]
        rows.append(turn_sample(ids[:-gen], ids[-gen:], [-5.0] * gen, rng.choice([-1.0, 1.0])))
    return collate(rows, pad_id=pad_id)


def measure(model: str, token_counts: list[int], checkpointing: bool, device: str = "cuda") -> list[dict]:
    import torch

    from agentrl.algos.losses import Objective, ppo_objective
    from agentrl.config import AlgoCfg
    from agentrl.learner.deepspeed_engine import DeepSpeedEngine
    from agentrl.learner.engine import EngineConfig, OptimConfig
    from agentrl.model_zoo import resolve_model

    obj = Objective.of(AlgoCfg())

    def loss_fn(mb, out):
        return ppo_objective(out["logp"], mb.old_logprobs, mb.advantages, mb.loss_mask, obj)

    folder = resolve_model(model)
    cuda = device.startswith("cuda")
    eng = DeepSpeedEngine(folder, EngineConfig(optim=OptimConfig(lr=1e-6, grad_clip=1.0), device=device,
                                               token_budget=max(token_counts), gradient_checkpointing=checkpointing),
                          DS_CONFIG)
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    eng.step(batch(min(token_counts), vocab, eng.pad_id, 0), loss_fn)  # Adam's states exist from here on
    out = []
    for i, n in enumerate(token_counts):
        eng.cfg.token_budget = n  # one micro-batch of n tokens
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        stats = eng.step(batch(n, vocab, eng.pad_id, i + 1), loss_fn)
        row = dict(tokens=n, checkpointing=checkpointing, micro_batches=stats["micro_batches"])
        if cuda:  # the CPU run (--device cpu) checks the code path only
            torch.cuda.synchronize()
            row.update(peak_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                       peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2))
        out.append(row)
    eng.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="tiny:KEY=N,... | an HF folder")
    p.add_argument("--tokens", default="2048,4096,8192", help="micro-batch sizes, comma-separated")
    p.add_argument("--checkpointing", action="store_true", help="per-layer activation checkpointing")
    p.add_argument("--plan-only", action="store_true", help="the plan's estimates only (no GPU)")
    p.add_argument("--device", default="cuda", help="cuda (default); cpu runs the steps without measuring")
    p.add_argument("--json", help="also write the rows here")
    a = p.parse_args(argv)
    counts = [int(x) for x in a.tokens.split(",")]
    if any(n < ROW or n % ROW for n in counts):
        print(f"error: --tokens {a.tokens}: each a multiple of {ROW}", file=sys.stderr)
        return 2
    rows = [dict(tokens=n, checkpointing=a.checkpointing) for n in counts] if a.plan_only else \
        measure(a.model, counts, a.checkpointing, a.device)
    for r in rows:
        r["plan"] = plan_estimate(a.model, r["tokens"], a.checkpointing)
        meas = f"peak {r['peak_allocated_gib']:.2f} GiB allocated" if "peak_allocated_gib" in r else "not measured"
        print(f"{r['tokens']} tokens, checkpointing {'on' if a.checkpointing else 'off'}: {meas}; plan "
              f"{r['plan']['total']:.2f} GiB ({', '.join(f'{k} {v}' for k, v in r['plan'].items() if k != 'total')})")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
