#!/usr/bin/env bash
# Wheels of what the GPU machine's Python lacks (it has torch with CUDA, accelerate, peft, numpy,
# safetensors, tokenizers, jinja2, httpx, aiohttp, xxhash, tiktoken, ...; it reaches no package
# registry), for CPython 3.12 on x86-64 Linux, pinned to this checkout's venv versions.
#
#   scripts/gpu_wheels.sh DIR      # then, there: pip install --no-index --no-deps --target T DIR/*.whl
#
# Seen on an H200 machine on 2026-11-26: with these on PYTHONPATH every GPU test and benchmark ran.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
DIR="$1"
PY="$(dirname "${BASH_SOURCE[0]}")/../.venv/bin/python"
[ -x "$PY" ] || { echo "no .venv: run 'make test' once first" >&2; exit 2; }
mkdir -p "$DIR"
PLATFORMS=()
for p in manylinux_2_17 manylinux_2_24 manylinux_2_26 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
    manylinux_2_34 manylinux_2_35 manylinux2014; do
    PLATFORMS+=(--platform "${p}_x86_64")
done
for name in fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection \
    typing_extensions gguf llguidance pyzmq msgspec transformers tokenizers; do
    version="$("$PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')"
    [ -n "$version" ] || { echo "$name is not installed in .venv" >&2; exit 2; }
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${PLATFORMS[@]}" -d "$DIR" "$name==$version"
done
ls "$DIR"
