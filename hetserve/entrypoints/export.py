"""`hetserve export`: merge a LoRA adapter into full model weights (`model/export.py`)."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    e = sub.add_parser(
        "export", help="merge a LoRA adapter into full model weights (a new model directory)"
    )
    e.add_argument("--model", required=True, help="the base model directory (HF safetensors)")
    e.add_argument("--adapter", required=True, help="a PEFT LoRA/DoRA adapter directory")
    e.add_argument("--out", required=True, help="the merged model's directory (new or empty)")
    e.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from hetserve.model.export import export_merged

    out = export_merged(args.model, args.adapter, args.out)
    print(f"merged model written to {out}")
    return 0
