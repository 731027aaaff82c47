"""GGUF files of random blocks in llama.cpp Q4_K_M's tensor types for a Qwen3-MoE shape, or
gpt-oss's published MXFP4 file's for a gpt-oss shape, streamed to disk with `gguf` one tensor at
a time (no checkpoint behind them): for memory, load and speed checks where only sizes matter,
from a test-sized model to Qwen3-30B-A3B's 17 GB and gpt-oss-20b's 12 GB (scripts/
gguf_big_check.py). Who calls it: that script and tests/model/test_load_memory.py.

Random blocks are valid numbers: each super-block's fp16 scales are set to small finite
values (random bytes there could be NaN or infinity), everything else is random bits. Types as
llama.cpp's Q4_K_M gives a Qwen3-MoE: q4_K for attention q / k / o and routed gate / up, q6_K for
attn_v and ffn_down_exps in every other layer (q4_K in the rest), q6_K for the output matrix,
q4_K token embeddings, f32 norms and routers. Failure: the writer's own (disk full, a shape
whose columns are not whole super-blocks of 256).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hetserve.testing.tiny_gguf_keys import gguf_metadata

# Qwen3-30B-A3B (its config.json)
SHAPE = {
    "hidden_size": 2048, "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6,
}  # fmt: skip
# gpt-oss-20b (its config.json), for write_random_gpt_oss: MXFP4 experts as published
GPT_OSS_20B = {
    "hidden_size": 2880, "num_hidden_layers": 24, "num_local_experts": 32,
    "num_experts_per_tok": 4, "intermediate_size": 2880, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "sliding_window": 128,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                        "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                        "beta_slow": 1.0},
}  # fmt: skip
# cols, bytes, fp16 d offsets (MXFP4: its e8m0 scale byte at 0)
BLOCK = {"Q4_K": (256, 144, (0, 2)), "Q6_K": (256, 210, (208,)), "Q8_0": (32, 34, (0,)),
         "MXFP4": (32, 17, ())}  # fmt: skip


def _random_blocks(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    n, nbytes, d_at = BLOCK[kind]
    raw = rng.integers(0, 256, size=(rows, cols // n, nbytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(2e-3 if kind != "Q8_0" else 2e-4).tobytes(), dtype=np.uint8)
    for at in d_at:  # d (and q4_K's dmin): small and finite
        raw[..., at : at + 2] = scale
    if kind == "MXFP4":
        raw[..., 0] = 120  # 2^-7: elements up to 6 x 2^-7
    return raw.reshape(rows, -1)


def expert_tensors_bytes(cfg: dict) -> int:
    """Bytes of the routed experts' tensors in the file `write_random_q4km` writes for `cfg`."""
    total = 0
    for name, shape, kind in _tensors(cfg):
        if "_exps." in name:
            n, nbytes, _ = BLOCK[kind]
            total += int(np.prod(shape[:-1])) * shape[-1] // n * nbytes
    return total


def _tensors(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, shape [.., rows, cols], type) in file order: llama.cpp's quantizer's, the
    output and embeddings first, then each block's tensors by name (so a layer's experts come
    down, gate, up: its last tensor read is up)."""
    h, e, i = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    d, nq, nkv, vocab = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], \
        cfg["vocab_size"]  # fmt: skip
    out = [("output.weight", (vocab, h), "Q6_K"), ("output_norm.weight", (h,), "F32"),
           ("token_embd.weight", (vocab, h), "Q4_K")]  # fmt: skip
    for b in range(cfg["num_hidden_layers"]):
        six = "Q6_K" if b % 2 == 0 else "Q4_K"
        out += sorted([
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
        ])  # fmt: skip
    return out


def write_random_q4km(path: Path, cfg: dict, progress: bool = False) -> int:
    """Write `cfg`'s model (SHAPE's keys) to `path`; its size in bytes."""
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen3moe")
    gguf_metadata(w, "qwen3moe", cfg)
    _placeholder_vocab(w, cfg["vocab_size"])
    _write_plan(w, _tensors(cfg), progress)
    return path.stat().st_size


def _placeholder_vocab(w, size: int) -> None:
    """A byte-level vocabulary: the 256 bytes' tokens, one merge (llama.cpp refuses a gpt2
    vocabulary without merges), then placeholders."""
    tokens = [bytes([b]).decode("latin-1") for b in range(256)] + ["ab"]
    tokens += [f"<|t{k}|>" for k in range(size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3] * (len(tokens) - 257))
    w.add_token_merges(["a b"])
    w.add_eos_token_id(len(tokens) - 1)


def _write_plan(w, plan: list[tuple[str, tuple[int, ...], str]], progress: bool) -> None:
    """The tensors of `plan` (name, shape, type) with random values, one at a time, and the
    file closed. F32 tensors: routers small random numbers, biases and sinks zero, norms one."""
    import gguf

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
            elif name.endswith((".bias", "attn_sinks.weight")):
                data = np.zeros(shape, dtype=np.float32)
            else:
                data = np.ones(shape, dtype=np.float32)
        else:
            rows = int(np.prod(shape[:-1]))
            data = _random_blocks(rng, rows, shape[-1], kind).reshape(*shape[:-1], -1)
        w.write_tensor_data(data)
        if progress and k % 60 == 0:
            print(f"  wrote {k + 1}/{len(plan)} tensors", flush=True)
    w.close()


def _gpt_oss_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """gpt-oss as its MXFP4 GGUF holds it: MXFP4 routed experts, q8_0 attention, embeddings
    and output (2,880 columns are no whole K-quant super-blocks), f32 norms, biases, sinks and
    routers."""
    h, e, i = cfg["hidden_size"], cfg["num_local_experts"], cfg["intermediate_size"]
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    vocab = cfg["vocab_size"]
    out = [("output.weight", (vocab, h), "Q8_0"), ("output_norm.weight", (h,), "F32"),
           ("token_embd.weight", (vocab, h), "Q8_0")]  # fmt: skip
    for b in range(cfg["num_hidden_layers"]):
        out += [
            (f"blk.{b}.attn_norm.weight", (h,), "F32"),
            (f"blk.{b}.post_attention_norm.weight", (h,), "F32"),
            (f"blk.{b}.attn_q.weight", (nq * d, h), "Q8_0"),
            (f"blk.{b}.attn_q.bias", (nq * d,), "F32"),
            (f"blk.{b}.attn_k.weight", (nkv * d, h), "Q8_0"),
            (f"blk.{b}.attn_k.bias", (nkv * d,), "F32"),
            (f"blk.{b}.attn_v.weight", (nkv * d, h), "Q8_0"),
            (f"blk.{b}.attn_v.bias", (nkv * d,), "F32"),
            (f"blk.{b}.attn_output.weight", (h, nq * d), "Q8_0"),
            (f"blk.{b}.attn_output.bias", (h,), "F32"),
            (f"blk.{b}.attn_sinks.weight", (nq,), "F32"),
            (f"blk.{b}.ffn_gate_inp.weight", (e, h), "F32"),
            (f"blk.{b}.ffn_gate_inp.bias", (e,), "F32"),
            (f"blk.{b}.ffn_gate_exps.weight", (e, i, h), "MXFP4"),
            (f"blk.{b}.ffn_up_exps.weight", (e, i, h), "MXFP4"),
            (f"blk.{b}.ffn_down_exps.weight", (e, h, i), "MXFP4"),
            (f"blk.{b}.ffn_gate_exps.bias", (e, i), "F32"),
            (f"blk.{b}.ffn_up_exps.bias", (e, i), "F32"),
            (f"blk.{b}.ffn_down_exps.bias", (e, h), "F32"),
        ]
    return out


def write_random_gpt_oss(path: Path, cfg: dict, progress: bool = False) -> int:
    """A gpt-oss-shaped file (GPT_OSS_20B's keys) of random blocks at `path`; its size."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gpt-oss")
    gguf_metadata(w, "gpt-oss", cfg)
    _placeholder_vocab(w, cfg["vocab_size"])
    _write_plan(w, _gpt_oss_tensors(cfg), progress)
    return path.stat().st_size
