#!/usr/bin/env bash
# RL methods and seeds from ONE warm start on one GPU (docs/studies/gpu.md): on CUDA the same seed can give
# two different warm starts, so a fair CRPS-vs-GRPO comparison starts every run from the very same weights.
#
#   bash scripts/studies/gpu_from_one_warm_start.sh OUT "crps:0 grpo:0" [extra overrides...]
#
# Makes OUT/ws (SmolLM2 fully fine-tuned by the ALFWorld overlay, ~3 min on an H200), then runs the given
# recipe:seed pairs PARALLEL at a time (default 2: two SmolLM2 runs hold ~70 GB of GPU memory, three
# 128 GiB), each until ENV_STEPS (default 6000) env steps, and writes OUT/summary.jsonl: the warm start's
# held-out success (read once, by the first run, per task type), then each run's at every later evaluation
# (and pass@k with eval.samples=k), also when the script is stopped early (`timeout`, Ctrl-C).
# MODEL (default smollm2) and ENV (default alfworld) choose the policy and env.
# READ_WS=after: no run reads the warm start at its step 0; a run of no steps from it (OUT/ws-read) reads
# it once the runs have ended, so every run gets the same time for its steps. RL_ARGS: overrides for the
# runs (and that reading) but not for the warm start's SFT, e.g. RL_ARGS="model.lora_r=16 model.lora_alpha=32":
# LoRA RL over a fully fine-tuned warm start.
set -euo pipefail
OUT=${1:?usage: $0 OUT \"recipe:seed ...\" [overrides]}
RUNS=${2:?usage: $0 OUT \"recipe:seed ...\" [overrides]}
shift 2
PY=${PY:-python3}
ENV=${ENV:-alfworld}
PARALLEL=${PARALLEL:-2}
read -ra RL <<< "${RL_ARGS:-}"
C=(--env "$ENV" --model "${MODEL:-smollm2}" trainer.tensorboard=false trainer.progress=false)
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
summarize() {
  $PY - "$OUT" "$ROOT" <<'EOF2' > "$OUT/summary.jsonl"
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from agentrl.metrics import read_metrics  # a run stopped mid-write leaves a torn last line: skipped
ws, out = [], []
# the warm start's own reading (READ_WS=after) first, when there is one
for m in sorted(Path(sys.argv[1]).glob("*/metrics.jsonl"), key=lambda m: (m.parent.name != "ws-read", m.parent.name)):
    if m.parent.name == "ws":
        continue
    rows = read_metrics(m.parent)
    ev = {r["step"]: r["eval/success"] for r in rows if "eval/success" in r}
    steps = sum(r.get("env_steps", 0) for r in rows if r.get("step", 0) > 0)
    row = {"run": m.parent.name, "eval_success": ev, "env_steps": steps}
    # sampled evaluation (eval.samples=k > 1): pass@k at every evaluation too
    pk = {r["step"]: {k[5:]: r[k] for k in r if k.startswith("eval/pass@") and k != "eval/pass@1"} for r in rows}
    if any(pk.values()):
        row["eval_pass"] = {s: v for s, v in pk.items() if v}
    # the one run that read the shared warm start (the first; the others skip it) gives the first line
    if rows and "eval/success" in rows[0] and not ws:
        kinds = {k.split("/")[-1]: v for k, v in rows[0].items() if k.startswith("eval/success/")}
        ws.append({"run": "warm_start", "eval_success": rows[0]["eval/success"], "by_type": kinds,
                   "read_by": m.parent.name})
    if m.parent.name != "ws-read":
        out.append(row)
for row in ws + out:
    print(json.dumps(row))
EOF2
  cat "$OUT/summary.jsonl"
}
# stopped early (`timeout`, Ctrl-C): stop the runs and still summarise what they logged
trap 'trap - TERM INT; kill $(jobs -p) 2>/dev/null || true; summarize; exit 124' TERM INT
if [[ ! -f "$OUT/ws/warm_start/config.json" ]]; then
  # no evaluation here: every run below evaluates these weights at its step 0 (in the background so that
  # a stop reaches the trap at once)
  $PY -m agentrl.cli train crps "${C[@]}" --seed 0 --out "$OUT/ws" "$@" trainer.steps=0 eval.tasks=0 > "$OUT/ws.log" 2>&1 &
  wait $!
fi
i=0
first=true  # greedy readings of the same weights are equal: only the first run reads the warm start
[[ "${READ_WS:-first}" == after ]] && first=false
for rs in $RUNS; do
  r=${rs%%:*} s=${rs##*:}
  $PY -m agentrl.cli train "$r" "${C[@]}" --seed "$s" --out "$OUT/$r-s$s" sft.warm_start="$OUT/ws/warm_start" \
    trainer.steps=40 trainer.env_steps="${ENV_STEPS:-6000}" eval.every=5 eval.at_start=$first "$@" "${RL[@]}" \
    > "$OUT/$r-s$s.log" 2>&1 &
  first=false
  (( ++i % PARALLEL == 0 )) && wait
done
wait
if [[ "${READ_WS:-first}" == after ]]; then
  $PY -m agentrl.cli train crps "${C[@]}" --seed 0 --out "$OUT/ws-read" sft.warm_start="$OUT/ws/warm_start" "$@" "${RL[@]}" \
    trainer.steps=0 eval.at_start=true > "$OUT/ws-read.log" 2>&1 &
  wait $!
fi
summarize
