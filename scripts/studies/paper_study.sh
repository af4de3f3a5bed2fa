#!/usr/bin/env bash
# Online paper recipes against GRPO from one SFT warm start, 3 seeds each, two runs at a time (one
# thread each), then one comparison plot over env steps and a table.
# One optimizer step per RL step and one rollout round (no dynamic sampling), as the study before the recipe fixes in
# docs/recipes/ was measured.
# Usage: bash scripts/studies/paper_study.sh OUT "grpo exp_replay crps spear" [STEPS]
#   OUT/sft/checkpoint/model must exist (bash scripts/studies/cpu_study.sh makes one); RL_ARGS adds overrides.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$1
RECIPES=$2
STEPS=${3:-15}
ENV=${ENV:-sokoban}
COMMON="--env $ENV --model $OUT/sft/checkpoint/model sft.enabled=false trainer.steps=$STEPS eval.every=5
  eval.tasks=${EVAL_TASKS:-96} eval.temperature=0.0 eval.split=valid trainer.tensorboard=false trainer.progress=false
  rollout.format_penalty=0.0 rollout.groups=16 rollout.slots=64 algo.turn_weight=episode
  algo.filters=[dropped,zero_variance] optim.lr=5.0e-5
  algo.mini_batches=1 algo.ppo_epochs=1 rollout.fill_groups=0 ${RL_ARGS:-}"
jobs=()
for r in $RECIPES; do for s in 0 1 2; do jobs+=("$r $s"); done; done
printf '%s\n' "${jobs[@]}" | xargs -P 2 -L 1 bash -c '
  [ -f "'"$OUT"'/$0-s$1/final.json" ] && exit 0
  OMP_NUM_THREADS=1 .venv/bin/agentrl train "$0" --seed "$1" --out "'"$OUT"'/$0-s$1" '"$(echo $COMMON)"' \
    > "'"$OUT"'/$0-s$1.log" 2>&1 || echo "$0 seed $1 failed (see '"$OUT"'/$0-s$1.log)"'
runs=()
for r in $RECIPES; do for s in 0 1 2; do runs+=("$OUT/$r-s$s"); done; done
.venv/bin/agentrl plot --compare "${runs[@]}" --out "$OUT/study_${ENV}_$(echo $RECIPES | tr ' ' '_').png"
.venv/bin/python scripts/studies/online_report.py "$OUT" $RECIPES
