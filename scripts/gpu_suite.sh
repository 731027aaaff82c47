#!/usr/bin/env bash
# Everything GPU in one 10-minute run (issue 40, part B): every @pytest.mark.gpu test, then the
# hybrid benchmark on a DeepSeek-V2-Lite-shaped random checkpoint (decode at batch 1 and 8 with
# CUDA graphs vs eager, --gpu-experts N, deferral d = 1, 2; prefill at 1k; the experts' share of
# the CPU's read bandwidth) and KV tiers on the GPU (a cached prefix loaded from host DRAM vs
# recompute). The longer runs (prefill 8k, the device_map offload peer, LoRA SFT vs PEFT) are
# scripts/gpu_bench_long.sh, a second 10-minute run.
#
#   scripts/gpu_suite.sh RESULTS_DIR [--dry-run] [--python PATH] [--budget S] [--layers N]
#       [--skip-pytest]   (the benchmarks alone, when the tests ran in a call of their own)
#
# How Python is found, the budget, the files written: scripts/gpu_lib.sh.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"

THREADS=$(nproc)
if [ "$DRY" = 1 ]; then
    PYTEST_MODE=(--collect-only)  # collection imports every GPU test; CUDA is never touched
    DEC=(--batch 1,8 --tokens 3 --repeats 1 --prompt-len 16 --prompt-lens 64 --bandwidth-mib 8)
    KV=(--prompt-len 64 --trials 1 --store-gb 0.25)
    CAL=(--num-prompts 2 --prompt-len 32 --max-tokens 2)
    HOT=2
else
    PYTEST_MODE=()
    DEC=(--batch 1,8 --tokens 32 --repeats 2 --prompt-len 64 --prompt-lens 1024)
    KV=(--prompt-len 4096 --trials 3)
    CAL=(--num-prompts 8 --prompt-len 128 --max-tokens 8)
    HOT=8
fi

env_step
mapfile -t GPU_TESTS < <(grep -rl --include='test_*.py' 'mark.gpu' tests | sort)
[ "$SKIP_PYTEST" = 1 ] || step pytest-gpu 180 "$PY" -m pytest -q -m gpu -rs "${PYTEST_MODE[@]}" \
    --junitxml "$RESULTS/pytest-gpu.xml" "${GPU_TESTS[@]}"
model_step
step calibrate 90 "${HS[@]}" calibrate --model "$MODEL_DIR" --device "$DEVICE" \
    --out "$RESULTS/routing-stats.json" "${CAL[@]}"
step hybrid 300 "${HS[@]}" bench hybrid --model "$MODEL_DIR" --device "$DEVICE" \
    --threads "$THREADS" "${DEC[@]}" --defer 1,2 --gpu-experts "$HOT" \
    --routing-stats "$RESULTS/routing-stats.json" --skip-peer --profile "$RESULTS/hybrid-profile.txt" --json "$RESULTS/hybrid.json"
step kv-tiers 120 "${HS[@]}" bench prefix --model "$MODEL_DIR" --device "$DEVICE" \
    --placement hybrid --tiers device,dram "${KV[@]}" --json "$RESULTS/kv-tiers.json"
summary
