#!/usr/bin/env bash
# Issue 8's small study, from the same SFT warm start as the online study (OUT/sft):
#  (1) pass@k, k = 1..64, of the warm start, GRPO (OUT/grpo-s0, from paper_study.sh), LEAFE and early_exp;
#  (2) RRO vs IPR: candidates sampled per step and greedy held-out success after DPO.
# Usage: bash scripts/studies/offline_study.sh OUT    (PASSK_TASKS=24 samples 64 per task at T=1)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$1
ENV=${ENV:-sokoban}
TASKS=${PASSK_TASKS:-24}
BIN=.venv/bin
SFT=$OUT/sft/checkpoint/model
COMMON="--env $ENV --model $SFT sft.enabled=false trainer.tensorboard=false trainer.progress=false
  rollout.format_penalty=0.0 rollout.slots=64"
PASSK="eval.tasks=$TASKS eval.samples=64 eval.temperature=1.0 eval.split=valid"
run() { OMP_NUM_THREADS=1 "$@"; }
# LEAFE and early_exp: one explore/collect + fit round, then pass@k
[ -f "$OUT/leafe_lr5e-5-s0/final.json" ] || run $BIN/agentrl train leafe --seed 0 --out "$OUT/leafe_lr5e-5-s0" $COMMON $PASSK \
  extra.tasks=32 > "$OUT/leafe_lr5e-5-s0.log" 2>&1 &
[ -f "$OUT/early_exp_lr5e-5-s0/final.json" ] || run $BIN/agentrl train early_exp --seed 0 --out "$OUT/early_exp_lr5e-5-s0" $COMMON \
  $PASSK extra.tasks=32 > "$OUT/early_exp_lr5e-5-s0.log" 2>&1 &
wait
# pass@k of the warm start and of GRPO's final policy
for m in sft grpo-s0; do
  model=$OUT/$m/checkpoint/model
  [ -f "$OUT/passk-$m.json" ] || run $BIN/agentrl eval --env "$ENV" --model "$model" --tasks "$TASKS" --samples 64 \
    eval.temperature=1.0 trainer.tensorboard=false > "$OUT/passk-$m.json" 2> "$OUT/passk-$m.log" &
done
wait
# RRO vs IPR
for r in rro ipr; do
  [ -f "$OUT/$r-s0/final.json" ] || run $BIN/agentrl train $r --seed 0 --out "$OUT/$r-s0" $COMMON eval.tasks=96 \
    eval.temperature=0.0 extra.tasks=16 > "$OUT/$r-s0.log" 2>&1 &
done
wait
$BIN/python scripts/studies/offline_report.py "$OUT" "$OUT/study_${ENV}_offline.png"
