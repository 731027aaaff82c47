"""`hetserve finetune CONFIG.yaml`: LoRA SFT from a LLaMA-Factory-style config."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser(
        "finetune",
        help="LoRA fine-tuning (SFT) from a LLaMA-Factory-style YAML config",
        description="LoRA/DoRA SFT with the routed experts on CPU backends (use_kt: true). "
        "Writes the adapter in PEFT's format, trainer_log.jsonl, checkpoints and plots to "
        "output_dir.",
    )
    p.add_argument("config", help="YAML file of LLaMA-Factory SFT keys")
    p.set_defaults(func=_run)


def _run(args) -> int:
    import json
    import sys

    from hetserve.finetune.config import load_config
    from hetserve.finetune.trainer import run

    cfg, notes = load_config(args.config)

    def say(line: str) -> None:
        print(line, file=sys.stderr)

    for note in notes:
        say(note)
    results = run(cfg, say)
    print(json.dumps(results, indent=2))
    return 0
