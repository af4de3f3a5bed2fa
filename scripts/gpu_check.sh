#!/usr/bin/env bash
# Check a GPU node before training on it, in at most 16 minutes on one GPU (20 on two) and without network:
#   1. the torch engine and the embedded generator on CUDA in bf16: 3 GRPO steps of a sized-up tiny model
#      (tiny:..., built here from the repo: no download, no model package) on Sokoban;
#   2. DeepSpeed ZeRO-3 on one rank over NCCL (2 steps of the same run);
#   3. the learner eager and with model.compile (agentrl bench learner, bf16);
#   4. a 7B-wide slice (Qwen2.5-7B's layer shape, 4 layers) on one ZeRO-3 rank: peak GPU memory of a step at
#      2k, 4k and 8k tokens, without and with activation checkpointing, beside the launch plan's estimate
#      (scripts/learner_memory.py);
#   5. with two GPUs or more: a GRPO run sampling from one vLLM server on GPU 1, weights synced over NCCL;
# then the tables: generated tokens/s, learner rows/s, peak GPU memory, whether each part ran; the slice's
# measured peaks against the plan.
#
#   bash scripts/gpu_check.sh                    # the check; logs and table.md in gpu-check-DATE/
#   bash scripts/gpu_check.sh --wheels DIR       # what is not importable (DeepSpeed...) from wheels in DIR
#   bash scripts/gpu_check.sh --dry-run          # any machine, no GPU: imports, configs, the commands it runs
#
# Options: --out DIR (a new folder; an existing one is refused), --python PY (default $PYTHON, else the
# project's environment: .venv-gpu/bin/python, then .venv/bin/python; never the system python3).
# Needs torch (a CUDA build: the node's own is fine), transformers, peft and agentrl (installed, or this
# checkout: it is put on PYTHONPATH). The model is tiny:... (MODEL below), built from this checkout.
# Wheels for a node without a package index, made on a connected machine with the node's Python version:
#   pip wheel --no-deps -w wheels deepspeed==0.19.8 einops hjson msgpack ninja py-cpuinfo   (+ gguf accelerate
#   gymnasium ... when the check lists them as not importable)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for v in .venv-gpu .venv; do [ -x "$ROOT/$v/bin/python" ] && { PY="$ROOT/$v/bin/python"; break; }; done
fi
DRY=0
WHEELS=""
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --wheels) WHEELS="${2:?--wheels needs a folder}"; shift ;;
    --out) OUT="${2:?--out needs a folder}"; shift ;;
    --python) PY="${2:?--python needs an interpreter}"; shift ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$PY" ]; then
  echo "error: no project environment (.venv-gpu or .venv in $ROOT): run make setup-gpu, or pass --python PY (an interpreter with torch)" >&2
  exit 2
fi
OUT="${OUT:-gpu-check-$(date +%Y%m%d-%H%M%S)}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
cd "$ROOT" || exit 2

# Per-part time limits (s): their sum keeps the whole check under 16 minutes on one GPU (20 with the vLLM part).
T_PREP=60 T_GRPO=130 T_DS=110 T_EAGER=40 T_COMPILE=110 T_SLICE_PREP=150 T_SLICE=180 T_VLLM=240

# What each part runs. Small enough for the time limits; the GRPO run keeps zero-variance groups
# (algo.filters=[dropped]) and has an entropy bonus (RAGEN's 0.001), so the learner trains every step even
# while the untrained model solves no level (all-zero advantages alone skip the update). The model: the tiny
# one sized to ~100M parameters (SmolLM2-135M's scale) so the GPU does real work, built offline.
MODEL="tiny:hidden_size=768,intermediate_size=2048,num_hidden_layers=12,num_attention_heads=12,num_key_value_heads=4"
RUN_ARGS=(--env sokoban --model "$MODEL" trainer.device=cuda model.autocast=bf16 sft.enabled=false
  "algo.filters=[dropped]" algo.entropy_coef=0.001 rollout.fill_groups=0 rollout.groups=8 rollout.group_size=4
  eval.tasks=16 eval.at_start=false trainer.checkpoint_every=100 trainer.tensorboard=false trainer.progress=false)
GRPO_CMD=("$PY" -m agentrl.cli train grpo "${RUN_ARGS[@]}" trainer.steps=3 eval.every=3 --out "$OUT/grpo")
DS_CMD=(env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT "$PY" -m torch.distributed.run --standalone --nproc_per_node=1
  -m agentrl.cli train grpo "${RUN_ARGS[@]}"
  trainer.steps=2 eval.every=2 trainer.engine=deepspeed trainer.deepspeed_config=configs/deepspeed/zero3.json
  --out "$OUT/deepspeed")
BENCH=("$PY" -m agentrl.cli bench learner --model "$MODEL" --device cuda --autocast bf16 --rows 32
  --lengths 200-600)
EAGER_CMD=("${BENCH[@]}" --learner-steps 6 --json "$OUT/eager.json")
COMPILE_CMD=("${BENCH[@]}" --learner-steps 6 --compile --json "$OUT/compile.json")
# The 7B-wide slice: Qwen2.5-7B's hidden, MLP and attention widths with 4 of its 28 layers (~0.9B parameters
# with the tiny vocabulary), so one rank's activations per token and layer are a 7B's, and they fit one GPU.
SLICE="tiny:hidden_size=3584,intermediate_size=18944,num_hidden_layers=4,num_attention_heads=28,num_key_value_heads=4"
SLICE_TOKENS=2048,4096,8192
SLICE_CMD=("$PY" scripts/learner_memory.py --model "$SLICE" --tokens "$SLICE_TOKENS")
SLICE_OFF_CMD=("${SLICE_CMD[@]}" --json "$OUT/slice-off.json")
SLICE_ON_CMD=("${SLICE_CMD[@]}" --checkpointing --json "$OUT/slice-on.json")
# Two GPUs or more: the learner on GPU 0, one vLLM server on GPU 1, the weights synced over NCCL each step
VLLM_CMD=("$PY" -m agentrl.cli train grpo "${RUN_ARGS[@]}" trainer.steps=2 eval.every=2 trainer.generator=vllm
  trainer.vllm_servers=1 "trainer.vllm_gpus=[1]" trainer.vllm_sync=nccl vllm.max_model_len=2048
  vllm.gpu_memory_utilization=0.5 --out "$OUT/vllm")

show() { local s; s="$(printf '%q ' "$@")"; echo "  ${s% }"; }
FAILED=()
check() {  # check NAME CMD...: run a CPU-side check, report it on one line
  local name="$1"; shift
  local msg
  if msg="$("$@" 2>&1)"; then
    echo "ok    $name${msg:+: $(tail -n1 <<<"$msg")}"
  else
    echo "FAIL  $name: $(tail -n1 <<<"$msg")"
    FAILED+=("$name")
  fi
}

echo "== agentrl GPU node check ($([ $DRY = 1 ] && echo dry run || echo "results in $OUT"))"
if [ $DRY = 0 ]; then  # first, so that a node without a usable GPU is one line before any work
  if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    build="$("$PY" -c 'import torch; print("torch", torch.__version__, "built for CUDA", torch.version.cuda)' 2>&1 | tail -n1)"
    echo "error: torch sees no CUDA device ($build); check the driver and CUDA_VISIBLE_DEVICES, or run --dry-run" \
      "to check the rest without a GPU" >&2
    exit 2
  fi
  if [ -e "$OUT" ]; then
    echo "error: $OUT exists; give a new folder with --out (nothing in it is touched)" >&2
    exit 2
  fi
fi
check "python" "$PY" -c 'import sys; assert sys.version_info >= (3, 10), sys.version; print(sys.version.split()[0])'
# What the parts import beyond torch, transformers and peft (module:package); a node without a package
# index gets the missing ones from --wheels DIR
NEED=(deepspeed:deepspeed gguf:gguf accelerate:accelerate gymnasium:gymnasium yaml:pyyaml rich:rich psutil:psutil
      safetensors:safetensors)
MISSING=()
for pair in "${NEED[@]}"; do
  "$PY" -c "import ${pair%%:*}" >/dev/null 2>&1 || MISSING+=("${pair#*:}")
done
DS_STATE="importable"
if [ ${#MISSING[@]} -gt 0 ]; then
  echo "note  not importable: ${MISSING[*]}"
  if [ -n "$WHEELS" ]; then
    check "the wheels in $WHEELS install ${MISSING[*]} without an index" \
      "$PY" -m pip install --dry-run --no-index --find-links "$WHEELS" "${MISSING[@]}"
    DS_STATE="from wheels"
    [ $DRY = 0 ] && check "installed from $WHEELS" "$PY" -m pip install -q --no-index --find-links "$WHEELS" "${MISSING[@]}"
  elif [ "${MISSING[*]}" = deepspeed ]; then
    DS_STATE="missing"
    echo "note  DeepSpeed is not importable: its part will not run (pass --wheels DIR with its wheels)"
  else
    echo "FAIL  packages: pass --wheels DIR with wheels of: ${MISSING[*]} (pip download / pip wheel on a connected machine)"
    FAILED+=("packages")
  fi
fi
# The rest in one Python process (each start imports torch): imports, the model, the DeepSpeed JSON, and
# each run's config resolved by the CLI itself with --print-config, without a GPU.
cli_args() {  # the agentrl.cli arguments of a command line
  local a=("$@"); while [ "${a[0]}" != -m ] || [ "${a[1]}" != agentrl.cli ]; do a=("${a[@]:1}"); done
  printf '%s\n' "${a[@]:2}"
}
preflight_out="$("$PY" - "$(cli_args "${GRPO_CMD[@]}")" "$(cli_args "${DS_CMD[@]}")" "$MODEL" \
  "$(cli_args "${VLLM_CMD[@]}")" 2>&1 <<'EOF'
import contextlib, importlib.util, io, sys
from pathlib import Path

def check(name, fn):
    try:
        print(f"ok    {name}: {fn()}")
    except BaseException as e:  # SystemExit from argparse included
        print(f"FAIL  {name}: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}")

def imports():
    import agentrl, peft, torch, transformers  # noqa: F401
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
            f"peft {peft.__version__}")

def tiny_model():
    from agentrl.commands.plan import model_config
    from agentrl.gpu_memory import ModelShape, param_count
    spec = sys.argv[3]
    return f"{spec} ({param_count(ModelShape.from_config(model_config(spec))) / 1e6:.0f}M parameters, built offline)"

def ds_json():
    from agentrl.learner.deepspeed_engine import load_ds_config
    return f"stage {load_ds_config('configs/deepspeed/zero3.json')['zero_optimization']['stage']}"

def config(argv):
    import torch
    from agentrl.cli import main
    buf = io.StringIO()
    if not torch.cuda.is_available():  # --print-config checks this machine, which has no GPU: plan for one
        with contextlib.redirect_stdout(buf):
            gpus = "2" if "trainer.generator=vllm" in argv else "1"  # one learner rank; a server's GPU beside it
            rc = main(argv + ["--dry-run", "--nodes", "1", "--gpus-per-node", gpus])
        if rc:
            raise RuntimeError(f"exit {rc}; the launch plan refuses it")
        return "planned for a GPU node (--dry-run: no GPU on this machine)"
    with contextlib.redirect_stdout(buf):
        rc = main(argv + ["--print-config"])
    text = buf.getvalue()
    if rc or "\n  device: cuda\n" not in text:
        raise RuntimeError(f"exit {rc}; trainer.device did not resolve to cuda")
    keys = ("engine", "device", "autocast", "steps")
    return " ".join(line.strip() for line in text.splitlines() if line.startswith("  ") and line.split(":")[0].strip() in keys)

def bench_flags():
    from agentrl.cli import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        main(["bench", "--help"])
    help_text = buf.getvalue()
    missing = [f for f in ("--device", "--compile", "--json", "--learner-steps") if f not in help_text]
    if missing:
        raise RuntimeError(f"no {' '.join(missing)}")
    return "yes"

check("torch, transformers, peft, agentrl import", imports)
check("the tiny model", tiny_model)
check("DeepSpeed JSON configs/deepspeed/zero3.json", ds_json)
check("config of the grpo run", lambda: config(sys.argv[1].splitlines()))
check("config of the deepspeed run", lambda: config(sys.argv[2].splitlines()))
check("config of the vllm run (two GPUs)", lambda: config(sys.argv[4].splitlines()))
check("agentrl bench learner takes --device, --compile, --json", bench_flags)
EOF
)"
echo "$preflight_out" | grep -E '^(ok|FAIL) '
while read -r line; do FAILED+=("${line#FAIL  }"); done < <(grep '^FAIL ' <<<"$preflight_out" | cut -d: -f1)
if ! grep -q '^ok    agentrl bench' <<<"$preflight_out" && ! grep -q '^FAIL  agentrl bench' <<<"$preflight_out"; then
  echo "FAIL  preflight: $(tail -n1 <<<"$preflight_out")"; FAILED+=("preflight")
fi
check "the launch plan's estimate for the 7B-wide slice at ${SLICE_TOKENS##*,} tokens" "${SLICE_CMD[@]}" --plan-only

echo "== planned commands (in this order; peak GPU memory sampled with nvidia-smi during each)"
show "$PY" -c "from agentrl.model_zoo import resolve_model; print(resolve_model('$MODEL'))"
show "${GRPO_CMD[@]}"
show "${DS_CMD[@]}"
show "${EAGER_CMD[@]}"
show "${COMPILE_CMD[@]}"
show "$PY" -c "from agentrl.model_zoo import resolve_model; print(resolve_model('$SLICE'))"
show "${SLICE_OFF_CMD[@]}"
show "${SLICE_ON_CMD[@]}"
echo "  (two GPUs or more:)"
show "${VLLM_CMD[@]}"

if [ ${#FAILED[@]} -gt 0 ]; then
  echo "error: ${#FAILED[@]} check(s) failed: $(printf '%s; ' "${FAILED[@]}" | sed 's/; $//')" >&2
  exit 1
fi
if [ $DRY = 1 ]; then
  echo "dry run passed: every check that needs no GPU"
  exit 0
fi

# ---- the check itself, on the GPU ----
mkdir -p "$OUT" || exit 2
GPU="${CUDA_VISIBLE_DEVICES:-0}"; GPU="${GPU%%,*}"
"$PY" -c '
import torch
p, v = torch.cuda.get_device_properties(0), torch.cuda.nccl.version()
nccl = ".".join(map(str, v)) if isinstance(v, tuple) else v
print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, bf16 {torch.cuda.is_bf16_supported()}, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, NCCL {nccl}")' | tee "$OUT/device.txt"

part() {  # part NAME LIMIT CMD...: run one part under a time limit, sampling GPU memory; status to NAME.status
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS sampler=""
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i "$GPU" -lms 500 >"$OUT/$name.gpumem" 2>/dev/null &
    sampler=$!
  fi
  echo "-- $name (at most ${limit} s)"
  timeout --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  [ -n "$sampler" ] && { kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null; }
  echo "$rc $((SECONDS - t0))" >"$OUT/$name.status"
  if [ $rc = 0 ]; then
    echo "   ran in $((SECONDS - t0)) s"
  else
    echo "   exit $rc after $((SECONDS - t0)) s (124: time limit); last lines of $OUT/$name.log:"
    tail -n 5 "$OUT/$name.log" | sed 's/^/   | /'
  fi
}

part prepare $T_PREP "$PY" -c "from agentrl.model_zoo import resolve_model; print(resolve_model('$MODEL'))"
part grpo $T_GRPO "${GRPO_CMD[@]}"
if [ "$DS_STATE" = missing ]; then
  echo "-- deepspeed: not run (DeepSpeed is not importable; pass --wheels DIR)" | tee "$OUT/deepspeed.log"
  echo "skipped 0" >"$OUT/deepspeed.status"
else
  part deepspeed $T_DS "${DS_CMD[@]}"
fi
part eager $T_EAGER "${EAGER_CMD[@]}"
part compile $T_COMPILE "${COMPILE_CMD[@]}"
if [ "$DS_STATE" = missing ]; then
  echo "-- slice: not run (DeepSpeed is not importable; pass --wheels DIR)" | tee "$OUT/slice-off.log"
  echo "skipped 0" >"$OUT/slice-off.status"
else
  part slice-prepare $T_SLICE_PREP "$PY" -c "from agentrl.model_zoo import resolve_model; print(resolve_model('$SLICE'))"
  part slice-off $T_SLICE "${SLICE_OFF_CMD[@]}"
  part slice-on $T_SLICE "${SLICE_ON_CMD[@]}"
fi
GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
if [ "${GPUS:-0}" -lt 2 ]; then
  echo "-- vllm: not run (one GPU visible; the part needs a second for the server)" | tee "$OUT/vllm.log"
  echo "skipped 0" >"$OUT/vllm.status"
elif ! "$PY" -c "import vllm" >/dev/null 2>&1; then
  echo "-- vllm: not run (vLLM is not importable in $PY)" | tee "$OUT/vllm.log"
  echo "skipped 0" >"$OUT/vllm.status"
else
  part vllm $T_VLLM "${VLLM_CMD[@]}"
fi

SLICE="$SLICE" SLICE_TOKENS="$SLICE_TOKENS" "$PY" - "$OUT" <<'EOF'
import json, os, re, sys
from pathlib import Path

out = Path(sys.argv[1])

def status(name):
    p = out / f"{name}.status"
    if not p.exists():
        return "not run", 0
    rc, secs = p.read_text().split()
    return {"0": "yes", "skipped": "not run", "124": "time limit", "137": "time limit"}.get(rc, f"failed ({rc})"), int(secs)

def peak(name):
    p = out / f"{name}.gpumem"
    vals = [int(x) for x in p.read_text().split() if x.isdigit()] if p.exists() else []
    return f"{max(vals) / 1024:.1f} GiB" if vals else "n/a"

def run_rates(folder):
    rows = []
    p = out / folder / "metrics.jsonl"
    if p.exists():
        rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    steps = [r for r in rows if r.get("step", 0) >= 1]
    gen_t = sum(r.get("time_generate_s", 0.0) for r in steps)
    learn = [r for r in steps if r.get("samples") and not r.get("skipped_update")]
    learn_t = sum(r.get("time_learn_s", 0.0) for r in learn)
    tok = f"{sum(r.get('generated_tokens', 0.0) for r in steps) / gen_t:.0f}" if gen_t else "n/a"
    rps = f"{sum(r['samples'] for r in learn) / learn_t:.1f}" if learn_t else "n/a"
    return tok, rps, len(steps)

def bench_rate(name):
    p = out / f"{name}.json"
    if not p.exists():
        return "n/a", ""
    fig = json.loads(p.read_text())
    return f"{fig['rows'] / fig['step_s']:.1f}", f"first step {fig['first_step_s']:.1f} s"

table = [("part", "ran", "generated tokens/s", "learner rows/s", "peak GPU memory", "time", "note")]
ran, secs = status("grpo")
tok, rps, n = run_rates("grpo")
table.append(("torch engine + embedded generator, bf16: GRPO, tiny ~100M, Sokoban", ran, tok, rps, peak("grpo"),
              f"{secs} s", f"{n} of 3 steps"))
ran, secs = status("deepspeed")
tok, rps, n = run_rates("deepspeed")
log = (out / "deepspeed.log").read_text(errors="replace") if (out / "deepspeed.log").exists() else ""
nccl = "NCCL INFO" in log or re.search(r"backend nccl", log)  # NCCL_DEBUG=INFO: its communicator's init lines
table.append(("DeepSpeed ZeRO-3, 1 rank", ran, tok, rps, peak("deepspeed"), f"{secs} s",
              f"{n} of 2 steps, {'NCCL communicator seen in the log' if nccl else 'no NCCL line in the log'}"))
ran, secs = status("vllm")
tok, rps, n = run_rates("vllm")
rows = [json.loads(x) for x in (out / "vllm" / "metrics.jsonl").read_text().splitlines() if x.strip()] \
    if (out / "vllm" / "metrics.jsonl").exists() else []
diff = max((r["sync_logprob_diff"] for r in rows if "sync_logprob_diff" in r), default=None)
sync = max((r["time_sync_s"] for r in rows if "time_sync_s" in r), default=None)
table.append(("vLLM server on GPU 1 + NCCL weight sync (2 GPUs)", ran, tok, rps, peak("vllm"), f"{secs} s",
              f"{n} of 2 steps" + (f", sync_logprob_diff {diff:.3g}" if diff is not None else "") +
              (f", sync {sync:.1f} s" if sync is not None else "")))
for name, label in (("eager", "learner, eager (bench learner, 32 rows of 200-600 tokens)"),
                    ("compile", "learner, model.compile (the same batches)")):
    ran, secs = status(name)
    rps, note = bench_rate(name)
    table.append((label, ran, "", rps, peak(name), f"{secs} s", note))

# the 7B-wide slice: each step's measured peak beside the plan's estimate for the same shape and tokens
slice_rows = [("tokens", "checkpointing", "ran", "peak allocated", "peak reserved", "plan", "measured / plan")]
for name in ("slice-off", "slice-on"):
    ran, _ = status(name)
    p = out / f"{name}.json"
    for r in (json.loads(p.read_text()) if p.exists() else []):
        got, plan = r.get("peak_allocated_gib"), r["plan"]["total"]
        slice_rows.append((str(r["tokens"]), "on" if r["checkpointing"] else "off", ran,
                           f"{got:.2f} GiB" if got is not None else "n/a",
                           f"{r['peak_reserved_gib']:.2f} GiB" if "peak_reserved_gib" in r else "n/a",
                           f"{plan:.2f} GiB", f"{got / plan:.2f}" if got is not None else ""))
    if not p.exists():
        slice_rows.append((os.environ.get("SLICE_TOKENS", ""), name.split("-")[1], ran, "n/a", "n/a", "", ""))
slice_ran = next((s for s in (status(n)[0] for n in ("slice-off", "slice-on")) if s != "yes"), "yes")
table.append(("7B-wide slice, 1 ZeRO-3 rank (table below)", slice_ran, "", "", "", "", ""))
lines = ["| " + " | ".join(table[0]) + " |", "|" + " --- |" * len(table[0])]
lines += ["| " + " | ".join(r) + " |" for r in table[1:]]
lines += ["", "7B-wide slice (" + os.environ.get("SLICE", "") + "), one ZeRO-3 rank, zero3.json (bf16):", "",
          "| " + " | ".join(slice_rows[0]) + " |", "|" + " --- |" * len(slice_rows[0])]
lines += ["| " + " | ".join(r) + " |" for r in slice_rows[1:]]
device = (out / "device.txt").read_text().strip() if (out / "device.txt").exists() else ""
text = f"{device}\n\n" + "\n".join(lines) + "\n"
(out / "table.md").write_text(text)
print("\n" + text)
print(f"peak GPU memory: nvidia-smi's memory.used for the whole device, sampled every 0.5 s; logs in {out}/")
sys.exit(0 if all(r[1] in ("yes", "not run") and (r[1] == "yes" or "vLLM" in r[0]) for r in table[1:]) else 1)
EOF
