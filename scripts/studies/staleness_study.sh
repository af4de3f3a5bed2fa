#!/usr/bin/env bash
# trainer.max_staleness 1 against the on-policy loop: make train's GRPO Sokoban run per seed (SFT warm start,
# then 30 steps), and the same run with the overlap from that run's very warm start; one run at a time.
# Usage: bash scripts/studies/staleness_study.sh OUT [SEEDS...]      (default seeds 0 1 2)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$1; shift
SEEDS=${*:-0 1 2}
mkdir -p "$OUT"
for s in $SEEDS; do
  sync="$OUT/sync-s$s" over="$OUT/stale1-s$s"
  [ -f "$sync/final.json" ] || /usr/bin/time -v .venv/bin/agentrl train grpo --env sokoban --seed "$s" \
    --out "$sync" > "$sync.log" 2>&1
  [ -f "$over/final.json" ] || /usr/bin/time -v .venv/bin/agentrl train grpo --env sokoban --seed "$s" \
    --out "$over" trainer.max_staleness=1 "sft.warm_start=$sync/warm_start" > "$over.log" 2>&1
done
.venv/bin/python scripts/studies/staleness_report.py "$OUT"
