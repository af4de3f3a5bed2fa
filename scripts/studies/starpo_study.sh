#!/usr/bin/env bash
# StarPO vs StarPO-S with RAGEN's settings (recipes/starpo*.yaml): 3 seeds each, two runs at a time (one
# thread each), each with its own SFT warm start; then the collapse indicators per run (held-out success
# at T = 0.5, in-group reward std, entropy, gradient norm, first -> last step) and a comparison plot.
# Usage: bash scripts/studies/starpo_study.sh OUT [ENV] [STEPS]     RL_ARGS adds overrides (dotted keys, or
#   "--model WARM sft.enabled=false" to start every run from one warm start)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$1
ENV=${2:-bandit}
STEPS=${3:-30}
mkdir -p "$OUT"
COMMON="--env $ENV trainer.steps=$STEPS eval.every=10 trainer.tensorboard=false trainer.progress=false ${RL_ARGS:-}"
jobs=()
for r in starpo starpo_s; do for s in 0 1 2; do jobs+=("$r $s"); done; done
printf '%s\n' "${jobs[@]}" | xargs -P 2 -L 1 bash -c '
  [ -f "'"$OUT"'/$0-s$1/final.json" ] && exit 0
  OMP_NUM_THREADS=1 .venv/bin/agentrl train "$0" --seed "$1" --out "'"$OUT"'/$0-s$1" '"$(echo $COMMON)"' \
    > "'"$OUT"'/$0-s$1.log" 2>&1 || echo "$0 seed $1 failed (see '"$OUT"'/$0-s$1.log)"'
runs=()
for r in starpo starpo_s; do for s in 0 1 2; do runs+=("$OUT/$r-s$s"); done; done
.venv/bin/agentrl plot --compare "${runs[@]}" --out "$OUT/study_${ENV}_starpo.png"
.venv/bin/python scripts/studies/starpo_report.py "$OUT"
