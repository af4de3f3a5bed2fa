#!/usr/bin/env bash
# The CPU study: one SFT warm start of the tiny model on expert demonstrations, then each RL recipe from
# that start with 3 seeds; held-out success before (step-0 eval) and after RL, a plot per recipe, a table.
# Usage: bash scripts/studies/cpu_study.sh [RL_STEPS] [OUT] [ENV] [SFT_DEMOS]
#   RECIPES="grpo crps" (default grpo)  EVAL_TASKS=96  RL_ARGS="optim.lr=1e-4 ..." (dotted overrides)
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${1:-20}
OUT=${2:-runs/study}
ENV=${3:-sokoban}
DEMOS=${4:-1500}
RECIPES=${RECIPES:-grpo}
BIN=.venv/bin
COMMON="trainer.tensorboard=false eval.tasks=${EVAL_TASKS:-96} eval.split=valid"
# an existing warm start in $OUT/sft is reused (the SFT stage is ~11 of the ~30 minutes)
[ -d "$OUT/sft/checkpoint/model" ] || $BIN/agentrl train sft --env "$ENV" --out "$OUT/sft" trainer.steps=1 \
  sft.demos="$DEMOS" sft.epochs=2 sft.batch_size=32 sft.lr=3.0e-3 eval.every=1 $COMMON
for recipe in $RECIPES; do
  for seed in 0 1 2; do
    [ -f "$OUT/$recipe-s$seed/final.json" ] && continue  # finished already
    $BIN/agentrl train "$recipe" --env "$ENV" --model "$OUT/sft/checkpoint/model" --seed "$seed" \
      --out "$OUT/$recipe-s$seed" sft.enabled=false trainer.steps="$STEPS" eval.every=5 $COMMON ${RL_ARGS:-}
  done
  $BIN/agentrl plot "$OUT/$recipe"-s0 "$OUT/$recipe"-s1 "$OUT/$recipe"-s2 --out "$OUT/cpu_study_${ENV}_$recipe.png"
done
$BIN/python - "$OUT" $RECIPES <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| recipe | seed | held-out success after SFT (step 0) | after RL | all-zero groups (first -> last step) |")
print("| --- | --- | --- | --- | --- |")
for recipe in sys.argv[2:]:
    for s in (0, 1, 2):
        rows = [json.loads(l) for l in (out / f"{recipe}-s{s}" / "metrics.jsonl").read_text().splitlines()]
        ev = [r for r in rows if "eval/success" in r]
        z = [r["all_zero_groups"] for r in rows if "all_zero_groups" in r]
        print(f"| {recipe} | {s} | {ev[0]['eval/success']:.3f} | {ev[-1]['eval/success']:.3f} | "
              f"{z[0]:.2f} -> {z[-1]:.2f} |")
PY
