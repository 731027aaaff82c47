#!/usr/bin/env bash
# The longer GPU benchmarks (issue 40, part B), a second 10-minute run after scripts/gpu_suite.sh
# (which builds the checkpoint this reuses): prefill at 1k and 8k prompts with the
# transformers + accelerate device_map CPU-offload peer's decode in the same run, and LoRA SFT
# with the experts on the CPU against transformers + PEFT (tokens/s, peak GPU memory); last, where
# the budget leaves time, the AMX tiles against AVX-512 on the box's Xeon (int16 and W8A8
# activations, tests/moe/test_amx.py) and their speed on one V2-Lite-shaped expert layer.
#
#   scripts/gpu_bench_long.sh RESULTS_DIR [--dry-run] [--python PATH] [--budget S] [--layers N]
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"

THREADS=$(nproc)
if [ "$DRY" = 1 ]; then
    PRE=(--prompt-lens 64,128 --tokens 3 --repeats 1 --prompt-len 16 --bandwidth-mib 8)
    FT=(--steps 1 --warmup 0 --seq-len 32)
    PYTEST_MODE=(--collect-only)
    AMX_TOKENS=16
else
    PRE=(--prompt-lens 1024,8192 --tokens 8 --repeats 1 --prompt-len 64)
    FT=(--steps 4 --warmup 1 --seq-len 512 --device cuda)
    PYTEST_MODE=()
    AMX_TOKENS=256,2048  # the kernels' own choice: AMX where the CPU and Linux give it
fi

env_step
model_step
step hybrid-long 360 "${HS[@]}" bench hybrid --model "$MODEL_DIR" --device "$DEVICE" \
    --threads "$THREADS" --batch 1 --defer '' --max-model-len 9216 "${PRE[@]}" \
    --json "$RESULTS/hybrid-long.json"
step finetune 200 "${HS[@]}" bench finetune --model "$MODEL_DIR" "${FT[@]}" \
    --json "$RESULTS/finetune.json"
step amx-tests 90 "$PY" -m pytest -q -rs "${PYTEST_MODE[@]}" --junitxml "$RESULTS/pytest-amx.xml" \
    tests/moe/test_amx.py -k "equal_avx512"
step amx-kernel 90 "${HS[@]}" bench moe-kernel --hidden 2048 \
    --inter 1408 --experts 64 --top-k 6 --tokens "$AMX_TOKENS" --iters 3 --threads "$THREADS" \
    --backends cpu-int8,cpu-int8:a8 --json "$RESULTS/amx-moe-kernel.json"
summary
