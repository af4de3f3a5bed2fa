#!/usr/bin/env bash
# One sitting on a borrowed GPU machine for scripts/gpu_from_one_warm_start.sh (docs/gpu.md, "Next time"),
# where each command copies at most 64 MiB to the machine and ends the processes it started, but the
# machine and its /tmp stay between commands. Run from the checkout there, one command each:
#
#   bash scripts/gpu_sitting.sh part                          # the first commands, each carrying a part
#   bash scripts/gpu_sitting.sh start LIMIT WAIT "crps:0 crps:1" [overrides]   # carrying the last part
#   bash scripts/gpu_sitting.sh collect WAIT                  # the next command, started at once
#   bash scripts/gpu_sitting.sh ship                          # for a study that spans sittings: its state,
#   bash scripts/gpu_sitting.sh give K                        # K = 1, 2, ...: four pieces a command
#
# part: copies the carried bundle/ parts to $SITTING/bundle (a later command's copy removes them from the
# checkout). start: unpacks them, copies the code to $SITTING/repo and starts the study there in its
# own process session under `timeout LIMIT`, so that it outlives this command, then prints its progress
# for up to WAIT seconds. collect: waits up to WAIT seconds for its summary, prints it and packs the runs'
# logs, metrics and configs (not the weights) into $OUT/results.tgz. ship: packs what a later sitting
# needs to resume the study (scripts/sitting_state.py: the warm start, unless it came from an earlier
# sitting, and each run's learner state) into pieces of 15 MiB and returns the digests and the first four
# pieces in $OUT; give K returns pieces 4K to 4K+3. Carried back (carry/NAME.partNN and carry/NAME.sha256,
# one part per command, as the bundle's), `part` keeps them and `start` unpacks them to $SITTING/r before
# the study, whose runs then resume. Extra `start` arguments are overrides for every run; PARALLEL,
# ENV_STEPS, MODEL, READING_S, READ_WS and RL_ARGS pass through to the study, whose runs stop stepping
# in time to end with a held-out reading before LIMIT (FINISH_BY, 10 s before it).
set -euo pipefail
S=${SITTING:-/tmp/sitting}
PY=${PY:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
USAGE="usage: $0 part | start LIMIT WAIT RUNS [overrides] | collect WAIT | ship | give K"
what=${1:?$USAGE}
shift
progress() {  # each run's last step and its held-out readings so far
  [[ -d $S/r ]] || return 0
  $PY - "$S/r" "$S/repo" <<'EOF' || true
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from agentrl.metrics import read_metrics
for m in sorted(Path(sys.argv[1]).glob("*/metrics.jsonl")):
    if m.parent.name == "ws":  # the warm start's own folder: no RL steps
        continue
    rows = read_metrics(m.parent)
    ev = " ".join(f"{r['step']}:{r['eval/success']:.3f}" for r in rows if "eval/success" in r)
    print(f"{m.parent.name}: step {rows[-1].get('step', 0) if rows else 0}, held-out {ev or '-'}")
EOF
}
wait_for_summary() {  # until the study's summary exists or $1 seconds have passed
  local end=$(( $(date +%s) + $1 ))
  while [[ ! -s $S/r/summary.jsonl ]] && (( $(date +%s) < end )); do sleep 5; done
}
keep_carried() {  # the parts this command carried, out of the checkout before a later copy removes them
  mkdir -p "$S/bundle" "$S/state"
  if compgen -G "bundle/bundle.tar.xz.part*" > /dev/null; then cp bundle/bundle.tar.xz.part* "$S/bundle/"; fi
  if compgen -G "carry/*" > /dev/null; then cp carry/* "$S/state/"; fi
}
pieces() {  # the packed pieces, in the order give hands them out
  ls "$S/ship" | grep '\.part[0-9]*$' | sort || true
}
give() {  # pieces 4K to 4K+3 of the packed state into $OUT (files of at most 16 MiB, 64 MiB a command)
  local out=${OUT:-$S/out} k=$1 p
  mkdir -p "$out"
  (( k == 0 )) && cp "$S"/ship/*.sha256 "$out/"
  for p in $(pieces | sed -n "$(( 4 * k + 1 )),$(( 4 * k + 4 ))p"); do cp "$S/ship/$p" "$out/"; done
  ls -l "$out"
}
case $what in
  part)
    keep_carried
    ls -l "$S/bundle" "$S/state"
    ;;
  start)
    limit=${1:?start LIMIT WAIT RUNS}; wait_s=${2:?start LIMIT WAIT RUNS}; runs=${3:?start LIMIT WAIT RUNS}
    shift 3
    mkdir -p "$S/repo"
    keep_carried
    if compgen -G "$S/bundle/bundle.tar.xz.part*" > /dev/null && [[ ! -f $S/deps/env.sh ]]; then
      $PY "$ROOT/scripts/offline_bundle.py" unpack "$S/bundle" "$S/deps"
    fi
    # the study runs from a copy of what it imports: a later command's copy of the checkout must not change it
    tar -C "$ROOT" -cf - agentrl envs recipes configs scripts | tar -C "$S/repo" -xf -
    if compgen -G "$S/state/*.sha256" > /dev/null && [[ ! -d $S/r/ws ]]; then  # an earlier sitting's: the runs resume
      $PY "$ROOT/scripts/sitting_state.py" unpack "$S/state" "$S/r"
    fi
    deps=""; [[ -f $S/deps/env.sh ]] && deps=$S/deps
    finish_by=$(( $(date +%s) + limit - 10 ))
    (cd "$S/repo" && DEPS=$deps FINISH_BY=$finish_by setsid nohup timeout "$limit" bash scripts/gpu_from_one_warm_start.sh "$S/r" "$runs" "$@" \
      > "$S/study.log" 2>&1 < /dev/null &)
    echo "study started at $(date +%T), stopped after $limit s at the latest; log $S/study.log"
    wait_for_summary "$wait_s"
    progress
    ;;
  collect)
    wait_for_summary "${1:?collect WAIT}"
    sleep 2  # the summary is written in one go, but give its writer a moment to exit
    cat "$S/r/summary.jsonl" 2>/dev/null || { echo "no summary yet: the study is still running"; progress; }
    out=${OUT:-$S/out}
    mkdir -p "$out"
    (cd "$S" && find r \( -name '*.jsonl' -o -name '*.log' -o -name '*.yaml' \) -not -path '*/checkpoint*' \
      -not -path '*/warm_start/*' | tar czf "$out/results.tgz" -T -)
    cp "$S/study.log" "$out/" 2>/dev/null || true
    ls -l "$out"
    ;;
  ship)
    if pgrep -f -- "--out $S/r/" > /dev/null; then
      echo "the study still runs: ship its state once it has ended (collect waits for it)" >&2; exit 1
    fi
    rm -rf "$S/ship"
    only=(); [[ -f $S/state/ws.sha256 ]] && only=(--only runs)  # the warm start was carried in: no need to return it
    $PY "$ROOT/scripts/sitting_state.py" pack "$S/r" "$S/ship" "${only[@]}"
    n=$(pieces | wc -l)
    more="nothing more to give"; (( n > 4 )) && more="then give 1 to give $(( (n - 1) / 4 ))"
    echo "$n pieces: this command returns the first 4 and the digests; $more"
    give 0
    ;;
  give)
    give "${1:?give K}"
    ;;
  *) echo "$USAGE" >&2; exit 2 ;;
esac
