"""`hetserve models make-tiny` (a random checkpoint of a real architecture) and
`hetserve convert` (routed experts in a CPU format)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hetserve.errors import InvalidInputError

_SIZE_OPTIONS = {
    "hidden_size": "hidden size",
    "intermediate_size": "dense MLP intermediate size",
    "moe_intermediate_size": "routed expert intermediate size",
    "num_hidden_layers": "number of layers",
    "num_attention_heads": "attention heads",
    "num_key_value_heads": "KV heads",
    "num_experts": "routed experts per layer",
    "num_experts_per_tok": "experts per token (top-k)",
    "vocab_size": "vocabulary size (at least the tokenizer's)",
    "max_position_embeddings": "context length",
}
# The HF key that holds the expert count differs per family.
_EXPERT_KEYS = {
    "mixtral": "num_local_experts",
    "deepseek-v2": "n_routed_experts",
    "deepseek-v3": "n_routed_experts",
    "glm4-moe": "n_routed_experts",
    "kimi-k2": "n_routed_experts",
    "gpt-oss": "num_local_experts",
    "kimi-linear": "num_experts",
    "deepseek-v3.2": "n_routed_experts",
    "minimax-m2": "num_local_experts",
}


def register(sub) -> None:
    p = sub.add_parser("models", help="model utilities")
    msub = p.add_subparsers(dest="models_cmd", metavar="CMD")
    msub.required = True
    t = msub.add_parser("make-tiny", help="write a tiny random checkpoint of a real architecture")
    t.add_argument(
        "--arch",
        required=True,
        help="family: llama, qwen2, qwen3, qwen2-moe, qwen3-moe, mixtral, deepseek-v2, "
        "deepseek-v3, glm4-moe, kimi-k2, gpt-oss, qwen3-next, qwen3.5-moe, kimi-linear, "
        "deepseek-v3.2, minimax-m2",
    )
    t.add_argument("out", help="output directory")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--layout", choices=["per-expert", "fused"], default="per-expert")
    t.add_argument(
        "--lm-head-scale",
        type=float,
        default=1.0,
        help="scale lm_head so greedy argmax margins are clear",
    )
    t.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weights' dtype on disk (bfloat16: half the bytes, for published-size shapes)",
    )
    for key, help_text in _SIZE_OPTIONS.items():
        t.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=help_text)
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="override any config.json key, e.g. --set first_k_dense_replace=1",
    )
    t.set_defaults(func=_make_tiny)

    v = sub.add_parser("convert", help="write routed experts in a CPU format (int8 / int4)")
    v.add_argument("--quant", required=True, choices=["int8", "int4"])
    v.add_argument(
        "--group-size", type=int, default=None, help="int4 group size (32, 64 default, 128)"
    )
    v.add_argument(
        "--layout",
        choices=["kernel", "portable"],
        default="kernel",
        help="kernel (default): the native kernels' own bytes, loaded by mapping the file; "
        "portable: int8/int4 safetensors any backend reads (quantized again at load)",
    )
    v.add_argument("model_dir")
    v.add_argument("out_dir")
    v.set_defaults(func=_convert)


def _overrides(args: argparse.Namespace) -> dict:
    out = {}
    for key in _SIZE_OPTIONS:
        value = getattr(args, key)
        if value is not None:
            out[_EXPERT_KEYS.get(args.arch, key) if key == "num_experts" else key] = value
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise InvalidInputError(f"--set expects KEY=JSON, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def _make_tiny(args: argparse.Namespace) -> int:
    from hetserve.model.export import require_new_dir
    from hetserve.testing.tiny import make_tiny_checkpoint

    require_new_dir(Path(args.out), "OUT")
    path = make_tiny_checkpoint(
        args.arch,
        args.out,
        seed=args.seed,
        overrides=_overrides(args),
        layout=args.layout,
        lm_head_scale=args.lm_head_scale,
        progress=True,
        dtype=args.dtype,
    )
    print(f"wrote {args.arch} checkpoint to {path}")
    asked = _overrides(args).get("vocab_size")
    got = json.loads((Path(path) / "config.json").read_text()).get("vocab_size")
    if asked is not None and got != asked:
        print(f"note: vocab_size is {got}, not {asked}: the tokenizer needs at least that many "
              "(its byte alphabet and special tokens)")  # fmt: skip
    return 0


def _convert(args: argparse.Namespace) -> int:
    from hetserve.model.convert import convert
    from hetserve.model.export import require_new_dir

    if args.group_size is not None and args.quant != "int4":
        raise InvalidInputError(
            f"--group-size is for --quant int4; {args.quant} has one scale per output row"
        )
    require_new_dir(Path(args.out_dir), "OUT_DIR")
    group = 64 if args.group_size is None else args.group_size
    out = convert(args.model_dir, args.out_dir, args.quant, group, args.layout)
    size = sum(f.stat().st_size for f in (*out.glob("*.safetensors"), *out.glob("*.hsk")))
    print(
        f"wrote {args.quant} experts to {out} ({size / 2**20:.1f} MiB of weights); serve it "
        f"with: hetserve serve --model {out}"
    )
    return 0
