#!/usr/bin/env bash
# The CPU default study: one SFT warm start of the tiny model on expert demonstrations, then GRPO from
# that start with 3 seeds; held-out success before (step-0 eval) and after RL, and a plot.
# Usage: bash scripts/cpu_study.sh [RL_STEPS] [OUT] [ENV] [SFT_DEMOS]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-20}
OUT=${2:-runs/study}
ENV=${3:-sokoban}
DEMOS=${4:-1500}
BIN=.venv/bin
COMMON="trainer.tensorboard=false eval.tasks=48 eval.split=valid"
$BIN/agentrl train sft --env "$ENV" --out "$OUT/sft" trainer.steps=1 sft.demos="$DEMOS" sft.epochs=2 \
  sft.batch_size=32 sft.lr=3.0e-3 eval.every=1 $COMMON
for seed in 0 1 2; do
  $BIN/agentrl train grpo --env "$ENV" --model "$OUT/sft/checkpoint/model" --seed "$seed" \
    --out "$OUT/grpo-s$seed" sft.enabled=false trainer.steps="$STEPS" eval.every=5 \
    rollout.groups=8 rollout.group_size=4 rollout.slots=32 optim.lr=1.0e-4 $COMMON
done
$BIN/agentrl plot "$OUT"/grpo-s0 "$OUT"/grpo-s1 "$OUT"/grpo-s2 --out "docs/cpu_study_$ENV.png"
$BIN/python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| seed | held-out success after SFT (step 0) | after GRPO |")
print("| --- | --- | --- |")
for s in (0, 1, 2):
    rows = [json.loads(l) for l in (out / f"grpo-s{s}" / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in rows if "eval/success" in r]
    print(f"| {s} | {ev[0]['eval/success']:.3f} | {ev[-1]['eval/success']:.3f} |")
PY
