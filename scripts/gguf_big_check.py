"""Issue 38's big-file check: a Qwen3-30B-A3B-shaped GGUF with llama.cpp Q4_K_M's tensor types
(~17 GB of random blocks, streamed to disk with `gguf` one tensor at a time), loaded and decoded
by hetserve in a child process whose resident and peak memory are read from /proc; the file is
deleted after. Not a test: it needs ~20 GB of disk and most of a 24 GiB box's memory. `--dir`
must be on a disk, not tmpfs (there the file itself would take memory, and the loader's
release of the file's pages would free nothing).

    .venv/bin/python scripts/gguf_big_check.py [--dir /tmp/gguf-30b] [--layers 48] [--keep]

Random blocks are valid numbers: each super-block's fp16 scales are set to small finite
values (random bytes there could be NaN or infinity), everything else is random bits. Types as
llama.cpp's Q4_K_M gives a Qwen3-MoE: q4_K for attention q / k / o and routed gate / up, q6_K for
attn_v and ffn_down_exps in every other layer (q4_K in the rest), q6_K for the output matrix,
q4_K token embeddings, f32 norms and routers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Qwen3-30B-A3B (its config.json)
SHAPE = {
    "hidden_size": 2048, "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6,
}  # fmt: skip
BLOCK = {"Q4_K": (256, 144, (0, 2)), "Q6_K": (256, 210, (208,))}  # cols, bytes, fp16 d offsets


def _random_blocks(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    n, nbytes, d_at = BLOCK[kind]
    raw = rng.integers(0, 256, size=(rows, cols // n, nbytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(2e-3).tobytes(), dtype=np.uint8)
    for at in d_at:  # d (and q4_K's dmin): small and finite
        raw[..., at : at + 2] = scale
    return raw.reshape(rows, -1)


def _tensors(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, shape [.., rows, cols], type) in file order."""
    h, e, i = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    d, nq, nkv, vocab = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], \
        cfg["vocab_size"]  # fmt: skip
    out = [("token_embd.weight", (vocab, h), "Q4_K")]
    for b in range(cfg["num_hidden_layers"]):
        six = "Q6_K" if b % 2 == 0 else "Q4_K"
        out += [
            (f"blk.{b}.attn_norm.weight", (h,), "F32"),
            (f"blk.{b}.attn_q.weight", (nq * d, h), "Q4_K"),
            (f"blk.{b}.attn_k.weight", (nkv * d, h), "Q4_K"),
            (f"blk.{b}.attn_v.weight", (nkv * d, h), six),
            (f"blk.{b}.attn_output.weight", (h, nq * d), "Q4_K"),
            (f"blk.{b}.attn_q_norm.weight", (d,), "F32"),
            (f"blk.{b}.attn_k_norm.weight", (d,), "F32"),
            (f"blk.{b}.ffn_norm.weight", (h,), "F32"),
            (f"blk.{b}.ffn_gate_inp.weight", (e, h), "F32"),
            (f"blk.{b}.ffn_gate_exps.weight", (e, i, h), "Q4_K"),
            (f"blk.{b}.ffn_up_exps.weight", (e, i, h), "Q4_K"),
            (f"blk.{b}.ffn_down_exps.weight", (e, h, i), six),
        ]
    out += [("output_norm.weight", (h,), "F32"), ("output.weight", (vocab, h), "Q6_K")]
    return out


def write(path: Path, cfg: dict) -> int:
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(0)
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    # a byte-level vocabulary: the 256 bytes' tokens, then placeholders
    tokens = [bytes([b]).decode("latin-1") for b in range(256)]
    tokens += [f"<|t{k}|>" for k in range(cfg["vocab_size"] - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * (len(tokens) - 256))
    w.add_token_merges([])
    w.add_eos_token_id(len(tokens) - 1)
    plan = _tensors(cfg)
    q = gguf.GGMLQuantizationType
    for name, shape, kind in plan:
        if kind == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
            continue
        n, nbytes, _ = BLOCK[kind]
        byte_shape = (*shape[:-1], shape[-1] // n * nbytes)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                          raw_dtype=q[kind])  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for k, (name, shape, kind) in enumerate(plan):
        if kind == "F32":
            if name.endswith("gate_inp.weight"):
                data = rng.standard_normal(shape, dtype=np.float32) * 0.02
            else:
                data = np.ones(shape, dtype=np.float32)
        else:
            rows = int(np.prod(shape[:-1]))
            data = _random_blocks(rng, rows, shape[-1], kind).reshape(*shape[:-1], -1)
        w.write_tensor_data(data)
        if k % 60 == 0:
            print(f"  wrote {k + 1}/{len(plan)} tensors", flush=True)
    w.close()
    return path.stat().st_size


CHILD = r"""
import json, sys, time
import torch, hetserve.model.build, hetserve.engine.core
from hetserve import LLM, SamplingParams
from hetserve.model.memory_facts import proc_memory as status
before = status()
t0 = time.perf_counter()
llm = LLM(sys.argv[1], max_model_len=256, num_kv_blocks=32)
loaded = time.perf_counter() - t0
after = status()
p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
t1 = time.perf_counter()
out = llm.generate(prompt_token_ids=[65, 66, 67, 68], sampling_params=p)[0]
gen = time.perf_counter() - t1
print(json.dumps({"before": before, "after_load": after, "end": status(), "load_s": loaded,
                  "generate_8_s": gen, "tokens": out.token_ids}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/gguf-30b")
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    ap.add_argument("--keep", action="store_true", help="keep the file")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    cfg = {**SHAPE, "num_hidden_layers": args.layers}
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "model-Q4_K_M.gguf"
    t = time.perf_counter()
    try:
        size = write(path, cfg)
        print(
            f"wrote {path}: {size / 2**30:.2f} GiB in {time.perf_counter() - t:.0f} s", flush=True
        )
        env = dict(os.environ)
        proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True,
                              text=True, env=env)  # fmt: skip
        sys.stderr.write(proc.stderr[-3000:])
        if proc.returncode != 0:
            print(f"child exited {proc.returncode}")
            return 1
        got = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:  # a write or a load that failed half-way leaves no 17 GB behind either
        if not args.keep and path.exists():
            path.unlink()
    base = got["before"]["VmRSS"]
    peak, res = got["end"]["VmHWM"] - base, got["after_load"]["VmRSS"] - base
    gib = 2**30
    print(
        f"file {size / gib:.2f} GiB; load {got['load_s']:.0f} s; resident after load "
        f"{res / gib:.2f} GiB ({res / size:.2f}x the file), peak {peak / gib:.2f} GiB "
        f"({peak / size:.2f}x), over {base / gib:.2f} GiB at start; 8 tokens in "
        f"{got['generate_8_s']:.1f} s: {got['tokens']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"file_bytes": size, "layers": args.layers, **got},
                                              indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
