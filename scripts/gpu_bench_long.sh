#!/usr/bin/env bash
# The longer GPU benchmarks (issue 40, part B), a second 10-minute run after scripts/gpu_suite.sh
# (which builds the checkpoint this reuses): prefill at 1k and 8k prompts with the
# transformers + accelerate device_map CPU-offload peer's decode in the same run, and LoRA SFT
# with the experts on the CPU against transformers + PEFT (tokens/s, peak GPU memory).
#
#   scripts/gpu_bench_long.sh RESULTS_DIR [--dry-run] [--python PATH] [--budget S] [--layers N]
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"

THREADS=$(nproc)
if [ "$DRY" = 1 ]; then
    PRE=(--prompt-lens 64,128 --tokens 3 --repeats 1 --prompt-len 16 --bandwidth-mib 8)
    FT=(--steps 1 --warmup 0 --seq-len 32)
else
    PRE=(--prompt-lens 1024,8192 --tokens 8 --repeats 1 --prompt-len 64)
    FT=(--steps 4 --warmup 1 --seq-len 512 --device cuda)
fi

env_step
model_step
step hybrid-long 360 "${HS[@]}" bench hybrid --model "$MODEL_DIR" --device "$DEVICE" \
    --threads "$THREADS" --batch 1 --defer '' --max-model-len 9216 "${PRE[@]}" \
    --json "$RESULTS/hybrid-long.json"
step finetune 200 "${HS[@]}" bench finetune --model "$MODEL_DIR" "${FT[@]}" \
    --json "$RESULTS/finetune.json"
summary
