"""`hetserve bench finetune`: LoRA training tokens/s and peak memory, hetserve vs transformers+PEFT.

Both systems train the same LoRA (same targets, rank, optimizer and learning rate) on the same
model, the same token sequences and the same batch, for the same number of steps, each in its
own fresh process (so each peak RSS is its own: weights, activations, optimizer state, plus the
same interpreter and torch baseline, which is also reported). hetserve keeps the routed
experts on the CPU backends (`use_kt`) with the native backward; transformers runs its own
modeling code with PEFT's layers. Rate = tokens of the timed steps / their wall time, after
warm-up steps; the whole plan runs `--rounds` times alternating the order, best round kept.

Beside the two systems, the limit of the machine, measured in the same run: the model FLOPs of a
training step (`train_flops_per_token`: the matrix products of the forward, the input gradients
of the backward, the LoRA weight gradients and causal attention; elementwise work left out) and
the best fp32 matrix-multiply rate of this CPU (`gemm_peak_gflops`). Their ratio to a system's
rate says how far from the arithmetic limit it runs, and so how much faster any implementation of
the same fp32 math could be at most.

`--device cuda` (issue 40's GPU half hour) trains on the GPU in bf16 with the routed experts on
the CPU: hetserve's own placement (the native backward on the host) against transformers + PEFT
with accelerate's `device_map` offload of the experts (moved onto the GPU each forward). Each row
then also gives the peak GPU memory (`torch.cuda.max_memory_allocated`); the CPU's fp32 limit is
not theirs, so it is left out.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from hetserve.errors import InvalidInputError


def register(sub) -> None:
    p = sub.add_parser("finetune", help="LoRA training tokens/s and peak memory vs HF + PEFT")
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--config", help="finetune YAML: takes lora_*, learning_rate, batch, cutoff_len")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 1)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 512)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--quantization-bit", type=int, choices=(8, 4), default=None)
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cuda: bf16 on the GPU, routed experts on the CPU (peer: device_map offload)",
    )  # fmt: skip
    p.add_argument("--json", help="write results here")
    p.add_argument("--plot", help="write a PNG bar chart here")
    p.set_defaults(func=_run)


def _settings(args) -> dict:
    s = {"lora_rank": 8, "lora_alpha": 16.0, "lora_target": "all", "learning_rate": 1e-4,
         "batch": 1, "seq_len": 512, "quantization_bit": None}  # fmt: skip
    if args.config:
        from hetserve.finetune.config import load_config

        cfg, _ = load_config(args.config)
        s.update(lora_rank=cfg.lora_rank, lora_alpha=cfg.alpha, lora_target=cfg.lora_target,
                 learning_rate=cfg.learning_rate, batch=cfg.per_device_train_batch_size,
                 seq_len=cfg.cutoff_len, quantization_bit=cfg.quantization_bit)  # fmt: skip
    for key, value in (("batch", args.batch), ("seq_len", args.seq_len),
                       ("quantization_bit", args.quantization_bit)):  # fmt: skip
        if value is not None:
            s[key] = value
    _check_counts(args, s)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InvalidInputError("--device cuda: no CUDA device here; use --device cpu")
    s.update(model=args.model, steps=args.steps, warmup=args.warmup, device=args.device)
    return s


def _check_counts(args, s: dict) -> None:
    """Before either system starts: --steps 0 divided by zero, --warmup -1 timed no step (a
    rate of millions of tokens/s), a sequence of 0 or 1 token has no next-token loss."""
    from hetserve.bench.common import require_at_least

    require_at_least(args, 1, "steps", "rounds")
    require_at_least(args, 0, "warmup")
    if args.plot and Path(args.plot).is_dir():  # savefig wrote DIR.png beside it
        raise InvalidInputError(f"--plot {args.plot}: is a directory; give a file name")
    if s["batch"] < 1 or s["seq_len"] < 2:
        raise InvalidInputError(
            f"need a batch >= 1 and a sequence >= 2 tokens, got {s['batch']} and {s['seq_len']}"
            " (--batch / --seq-len, or the config's batch and cutoff_len)"
        )


def _run(args) -> int:
    from hetserve.bench.common import print_table, write_json

    s = _settings(args)
    systems = ["hetserve", "transformers+peft"]
    best: dict[str, dict] = {}
    rounds = []
    for r in range(args.rounds):
        for name in systems if r % 2 == 0 else systems[::-1]:
            try:
                res = _spawn(name, s)
            except RuntimeError as exc:  # one system failing still reports the other
                print(exc, file=sys.stderr)
                rounds.append({"round": r, "system": name, "error": str(exc)})
                continue
            rounds.append({"round": r, **res})
            if name not in best or res["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = res
    print_table(["system", "train tok/s", "vs HF", "peak RSS MiB", "baseline MiB",
                 "RSS vs HF", "last loss", "peak GPU MiB"], _rows(best, systems))  # fmt: skip
    result = {"settings": s, "best": best, "rounds": rounds}
    if s["device"] == "cpu" and len(best) == len(systems):
        result["limit"] = _cpu_limit(s, best)
    write_json(args.json, {"benchmark": "finetune", **result})  # with the machine's facts
    if args.plot:
        _plot(best, args.plot)
    return 0


def _rows(best: dict, systems: list[str]) -> list[list[str]]:
    hf = best.get("transformers+peft")

    def vs_hf(b: dict, key: str) -> str:
        return f"{b[key] / hf[key]:.2f}" if hf else "-"

    rows = []
    for name in systems:
        b = best.get(name)
        if b is None:
            rows.append([name, "failed"] + ["-"] * 6)
            continue
        rows.append([
            name, f"{b['tokens_per_s']:.0f}", vs_hf(b, "tokens_per_s"),
            f"{b['peak_rss_mib']:.0f}", f"{b['baseline_rss_mib']:.0f}",
            vs_hf(b, "peak_rss_mib"), f"{b['final_loss']:.3f}",
            f"{b['peak_gpu_mib']:.0f}" if "peak_gpu_mib" in b else "-",
        ])  # fmt: skip
    return rows


def _cpu_limit(s: dict, best: dict) -> dict:
    """The fp32 arithmetic limit of this CPU for the model's training FLOPs, printed."""
    hf = best["transformers+peft"]
    flops = train_flops_per_token(s["model"], s["seq_len"], s["lora_rank"], s["lora_target"])
    peak = gemm_peak_gflops()
    for b in best.values():
        b["model_gflops_per_s"] = b["tokens_per_s"] * flops / 1e9
    limit = {"model_flops_per_token": flops, "gemm_peak_gflops": peak,
             "hf_fraction_of_peak": hf["model_gflops_per_s"] / peak,
             "max_speedup_over_hf": peak / hf["model_gflops_per_s"]}  # fmt: skip
    print(f"model FLOPs per token {flops / 1e6:.1f} M; fp32 GEMM peak of this CPU "
          f"{peak:.0f} GFLOP/s; " + "; ".join(
              f"{n} {b['model_gflops_per_s']:.0f} GFLOP/s ({b['model_gflops_per_s'] / peak:.2f} of"
              " peak)" for n, b in best.items()) +
          f"; no fp32 implementation can pass {limit['max_speedup_over_hf']:.2f}x HF")  # fmt: skip
    return limit


def train_flops_per_token(model_dir: str, seq_len: int, rank: int, target: str) -> float:
    """Model FLOPs of one trained token (frozen base, LoRA on `target`): per linear (and
    router) 2 x in x out forward and the same for its input gradient; per routed expert used
    (top-k) its three matrices likewise; LoRA's A and B forward, input and weight gradients;
    causal attention's two products (mean length (L + 1) / 2) forward, twice that backward."""
    import torch
    from torch import nn

    from hetserve.finetune.model import linear_module_names
    from hetserve.layers.moe import FusedExperts
    from hetserve.moe.router import TopKRouter

    with torch.device("meta"):
        model = _meta_model(model_dir)
    cfg = model.config
    targets = set(linear_module_names(model) if target == "all" else target.split(","))
    top_k = int(cfg.get("num_experts_per_tok", default=0))
    flops = 0.0
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            flops += 4 * m.in_features * m.out_features
            if name.rpartition(".")[2] in targets:
                flops += 6 * rank * (m.in_features + m.out_features)
        elif isinstance(m, TopKRouter):
            flops += 4 * m.weight.shape[0] * m.weight.shape[1]
        elif isinstance(m, FusedExperts):
            flops += 4 * top_k * 3 * m.hidden_size * m.intermediate_size
    attention = 2 * 2 * cfg.num_heads * cfg.head_dim * (seq_len + 1) / 2
    return flops + 3 * attention * cfg.num_layers


def gemm_peak_gflops(sizes: tuple[int, ...] = (512, 1024, 2048), repeats: int = 5) -> float:
    """The best fp32 matrix-multiply rate of this CPU with torch's threads (square products)."""
    import torch

    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        calls = max(1, int(2e9 / (2 * n**3)))
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                torch.mm(a, b)
            best = max(best, 2 * n**3 * calls / (time.perf_counter() - t0) / 1e9)
    return best


def _spawn(system: str, s: dict) -> dict:
    cmd = [sys.executable, "-m", "hetserve.bench.finetune", system, json.dumps(s)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"{system} worker failed: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _data(s: dict, vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    n = s["steps"] + s["warmup"]
    return [torch.randint(0, vocab, (s["batch"], s["seq_len"]), generator=g) for _ in range(n)]


def _rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _hetserve_step_fn(s: dict):
    import torch

    from hetserve.finetune.model import (
        ExpertsPlacement,
        add_lora,
        load_for_training,
        lora_parameters,
    )
    from hetserve.finetune.trainer import loss_sum

    bits = s["quantization_bit"] or 32
    device = s["device"]
    dtype = "bfloat16" if device == "cuda" else "float32"
    model = load_for_training(s["model"], device, dtype, ExpertsPlacement(True, bits=bits))
    target = s["lora_target"]
    add_lora(model, target if target == "all" else target.split(","), s["lora_rank"],
             s["lora_alpha"], 0.0, False)  # fmt: skip
    model.train()
    opt = torch.optim.AdamW(lora_parameters(model), lr=s["learning_rate"])

    def step(batch) -> float:
        items = [(row.tolist(), row.tolist()) for row in batch]
        opt.zero_grad(set_to_none=True)
        total, n = loss_sum(model, items, torch.device(device))
        (total / n).backward()
        opt.step()
        return float(total.detach()) / n

    return step, model.config.vocab_size


def _hf_step_fn(s: dict):
    import peft
    import torch
    import transformers

    from hetserve.finetune.model import linear_module_names

    device = "cuda:0" if s["device"] == "cuda" else "cpu"
    if device != "cpu":
        from hetserve.bench.hybrid import offload_device_map

        model = transformers.AutoModelForCausalLM.from_pretrained(
            s["model"], dtype=torch.bfloat16, device_map=offload_device_map(s["model"])
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    target = s["lora_target"]
    if target == "all":  # the same modules as ours (names from our class, no weights loaded)
        with torch.device("meta"):
            target = linear_module_names(_meta_model(s["model"]))
    else:
        target = target.split(",")
    config = peft.LoraConfig(r=s["lora_rank"], lora_alpha=s["lora_alpha"], lora_dropout=0.0,
                             target_modules=target, task_type="CAUSAL_LM")  # fmt: skip
    model = peft.get_peft_model(model, config)
    model.train()
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=s["learning_rate"]
    )

    def step(batch) -> float:
        batch = batch.to(device)
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step, model.config.vocab_size


def _meta_model(model_dir: str):
    from hetserve.model.config import ModelConfig
    from hetserve.model.registry import model_class

    cfg = ModelConfig.from_dir(model_dir)
    return model_class(cfg.architecture)(cfg)


def worker(system: str, s: dict) -> dict:
    import torch  # the baseline includes torch, as in both systems

    baseline = _rss_mib()
    step, vocab = (_hetserve_step_fn if system == "hetserve" else _hf_step_fn)(s)
    data = _data(s, vocab)
    loss = 0.0
    for batch in data[: s["warmup"]]:
        loss = step(batch)  # float(loss) waits for the device: each step ends synchronized
    t0 = time.perf_counter()
    for batch in data[s["warmup"] :]:
        loss = step(batch)
    seconds = time.perf_counter() - t0
    tokens = s["steps"] * s["batch"] * s["seq_len"]
    out = {"system": system, "tokens_per_s": tokens / seconds, "seconds": seconds,
           "peak_rss_mib": _rss_mib(), "baseline_rss_mib": baseline,
           "final_loss": loss}  # fmt: skip
    if s["device"] == "cuda":
        out["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def _plot(best: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(best)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    axes[0].bar(names, [best[n]["tokens_per_s"] for n in names], color=["#d62728", "#7f7f7f"])
    axes[0].set_ylabel("training tokens/s")
    axes[1].bar(names, [best[n]["peak_rss_mib"] for n in names], color=["#d62728", "#7f7f7f"])
    axes[1].set_ylabel("peak RSS (MiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    print(json.dumps(worker(sys.argv[1], json.loads(sys.argv[2]))))
