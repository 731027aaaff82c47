# Shared by scripts/gpu_suite.sh and scripts/gpu_bench_long.sh (sourced, not run).
#
# The GPU machine reaches no package registry: nothing here installs anything. Python is, in
# order, --python PATH, $HETSERVE_PYTHON, the repository's .venv/bin/python, python3; it must
# already have torch (CUDA build on the GPU machine), transformers, peft and hetserve's own
# dependencies. The scripts run from the repository root so `hetserve` is this tree's.
#
# Every step runs under `timeout` inside the script's overall budget (--budget seconds, 600 by
# default): a step gets min(its own limit, what is left - 15 s). Each step writes
# RESULTS_DIR/NAME.log (and NAME.json where it produces one); RESULTS_DIR/steps.tsv lists
# name, exit status, seconds; the end prints one summary table (scripts/gpu_summary.py).
# --dry-run rehearses every step on the CPU with tiny sizes (device cpu, pytest collection
# only): what fails there would fail on the GPU machine for a reason that is not the GPU.

set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

usage() {
    echo "usage: $0 RESULTS_DIR [--dry-run] [--python PATH] [--budget SECONDS]" \
        "[--model-dir DIR] [--layers N] [--skip-pytest]" >&2
    exit 2
}

RESULTS="" DRY=0 SKIP_PYTEST=0 PY="${HETSERVE_PYTHON:-}" BUDGET=600 MODEL_DIR="" LAYERS=27
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --skip-pytest) SKIP_PYTEST=1 ;;
        --python) shift; [ $# -gt 0 ] || usage; PY="$1" ;;
        --budget) shift; [ $# -gt 0 ] || usage; BUDGET="$1" ;;
        --model-dir) shift; [ $# -gt 0 ] || usage; MODEL_DIR="$1" ;;
        --layers) shift; [ $# -gt 0 ] || usage; LAYERS="$1" ;;
        -h|--help) usage ;;
        -*) echo "unknown option: $1" >&2; usage ;;
        *) [ -z "$RESULTS" ] || usage; RESULTS="$1" ;;
    esac
    shift
done
[ -n "$RESULTS" ] || usage
case "$BUDGET$LAYERS" in *[!0-9]*) echo "--budget and --layers take integers" >&2; exit 2 ;; esac
if [ -z "$PY" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
command -v "$PY" >/dev/null 2>&1 || { echo "python not found: $PY (use --python)" >&2; exit 2; }
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
: > "$RESULTS/steps.tsv"
START=$SECONDS
HS=("$PY" -m hetserve.cli)

if [ "$DRY" = 1 ]; then
    DEVICE=cpu
    MODEL_DIR="${MODEL_DIR:-$RESULTS/model-dry}"
else
    DEVICE=cuda
    MODEL_DIR="${MODEL_DIR:-${TMPDIR:-/tmp}/hetserve-v2lite-$LAYERS}"
fi

# step NAME LIMIT_S CMD...: run CMD under timeout with its log; never stops the script.
step() {
    local name="$1" limit="$2"
    shift 2
    local left=$((BUDGET - (SECONDS - START) - 15))
    [ "$limit" -lt "$left" ] || limit="$left"
    if [ "$limit" -le 0 ]; then
        printf '%s\t%s\t%s\n' "$name" "skipped-budget" 0 >> "$RESULTS/steps.tsv"
        echo "== $name: skipped (budget spent)"
        return 0
    fi
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    rc=$?
    [ "$rc" = 124 ] && echo "timed out after ${limit}s" >> "$RESULTS/$name.log"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$RESULTS/steps.tsv"
    tail -n 3 "$RESULTS/$name.log" | sed 's/^/   /'
}

# The machine: GPU name, CPU model, threads, versions (JSON), before anything else.
env_step() {
    step env 60 "$PY" - "$RESULTS/env.json" "$DRY" <<'PYEOF'
import json, os, platform, subprocess, sys
import torch
info = {"python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu_threads": os.cpu_count(), "dry_run": sys.argv[2] == "1"}
try:
    info["cpu"] = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                       if l.startswith("model name"))
except (OSError, StopIteration):
    info["cpu"] = platform.processor()
for mod in ("transformers", "peft", "accelerate", "hetserve"):
    try:
        info[mod] = __import__(mod).__version__ if mod != "hetserve" else "importable"
    except Exception as exc:  # a missing peer is a finding, not a crash
        info[mod] = f"unavailable: {exc}"
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info))
PYEOF
}

# A DeepSeek-V2-Lite-shaped random checkpoint (27 layers, 64 routed experts top-6, 2 shared,
# MLA, bf16; ~31 GB), built once and reused by both scripts; tiny in a dry run.
model_step() {
    if [ -f "$MODEL_DIR/config.json" ]; then
        printf '%s\t%s\t%s\n' model reused 0 >> "$RESULTS/steps.tsv"
        echo "== model: reusing $MODEL_DIR"
        return 0
    fi
    local shape=(--hidden-size 2048 --intermediate-size 10944 --moe-intermediate-size 1408
        --num-hidden-layers "$LAYERS" --num-attention-heads 16 --num-key-value-heads 16
        --num-experts 64 --vocab-size 102400 --max-position-embeddings 16384
        --set kv_lora_rank=512 --set qk_nope_head_dim=128 --set qk_rope_head_dim=64
        --set v_head_dim=128)
    [ "$DRY" = 1 ] && shape=(--num-hidden-layers 3 --num-experts 8)
    step model 300 "${HS[@]}" models make-tiny --arch deepseek-v2 "$MODEL_DIR" --dtype bfloat16 \
        --num-experts-per-tok 6 --set n_shared_experts=2 --set first_k_dense_replace=1 \
        --set n_group=1 --set topk_group=1 --set 'topk_method="greedy"' "${shape[@]}"
}

summary() {
    "$PY" "$ROOT/scripts/gpu_summary.py" "$RESULTS"
}
