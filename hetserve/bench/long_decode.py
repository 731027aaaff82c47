"""`hetserve bench long-decode`: one stream's decode step at long contexts, and where it goes.

For `--model` and each `--peer` (for the issue-37 goal: the same Qwen3-Next shape with its
linear-attention layers replaced by full attention, `models make-tiny ... --set
full_attention_interval=1`), the time of a decode step at each of `--contexts`, the tokens/s it
means, each model's time at a context over its time at the first one, and the peer's over the
model's at the same context (the speed-up of the model). Beside it, where a step's time goes:
per module kind (full attention, linear attention, MoE or MLP, the rest), timed with forward
hooks on each decoder layer's mixer and MLP in separate steps (the hooks' own cost stays out of
the step times).

The context is laid in the KV cache without computing it (the blocks of C tokens and a state
slot, as they are): a decode step costs the same whatever the cached values (attention reads
every row of the context, a linear-attention state is fixed-size, a MoE layer runs its top-k
experts either way), and a 32k-token prefill of full attention takes minutes on a 2-core CPU.
The steps run through the engine's own runner, on the model the engine loaded (`--placement`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from hetserve.bench.common import print_table, write_json

Kinds = dict[str, float]


def register(sub) -> None:
    p = sub.add_parser(
        "long-decode", help="decode step time at long contexts, vs a peer, with a profile"
    )
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--peer", action="append", default=[], help="model(s) to compare against")
    p.add_argument("--contexts", default="2048,8192,32768", help="context lengths (tokens)")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per context")
    p.add_argument("--placement", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", "--result-file", dest="json", default=None, help="write JSON here")
    p.set_defaults(func=run)


def _contexts(text: str) -> list[int]:
    try:
        out = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        from hetserve.errors import InvalidInputError

        raise InvalidInputError(f"--contexts: positive integers separated by commas, got {text!r}")
    return out


def _hooks(model: torch.nn.Module, kinds: Kinds) -> list[Callable[[], None]]:
    """Time each decoder layer's token mixer and MLP into `kinds` (seconds, summed)."""
    removers = []
    for layer in model.model.layers:
        for name in (getattr(layer, "attn_name", "self_attn"), getattr(layer, "mlp_name", "mlp")):
            mod = getattr(layer, name, None)
            if mod is None:
                continue
            kind = {"self_attn": "attention", "linear_attn": "linear attention"}.get(name, "mlp")
            start: list[float] = []

            def pre(_m, _a, start=start) -> None:
                start.append(time.perf_counter())

            def post(_m, _a, _o, start=start, kind=kind) -> None:
                kinds[kind] = kinds.get(kind, 0.0) + time.perf_counter() - start.pop()

            removers += [mod.register_forward_pre_hook(pre).remove]
            removers += [mod.register_forward_hook(post).remove]
    return removers


def _measure(path: str, contexts: list[int], args: argparse.Namespace) -> dict:
    from hetserve import LLM

    bs, steps = args.block_size, args.steps
    longest = max(contexts) + steps + 2
    llm = LLM(
        path, max_model_len=longest + bs, num_kv_blocks=-(-longest // bs) + 2, block_size=bs,
        enable_prefix_caching=False, max_num_seqs=1, placement=args.placement,
    )  # fmt: skip
    if longest > llm.engine.max_model_len:
        from hetserve.errors import InvalidInputError

        raise InvalidInputError(
            f"--contexts: {max(contexts)} tokens and {steps} steps need {longest} positions, "
            f"{path} has {llm.engine.max_model_len} (max_position_embeddings); use shorter contexts"
        )
    runner = llm.engine.runner
    slot = None if runner.state is None else 1  # slot 0 is never a request's
    rows = {c: _context(runner, c, slot, args) for c in contexts}
    summary = llm.engine.placement_summary
    del llm
    return {"model": path, "placement": summary, "contexts": rows}


def _context(runner, c: int, slot: int | None, args: argparse.Namespace) -> dict:
    """Decode steps at context `c` (median time) and one more step's profile."""
    from hetserve.engine.runner import SeqInput

    bs, steps = args.block_size, args.steps
    blocks = list(range(1, -(-(c + steps + 2) // bs) + 1))
    token = 1

    def step(at: int) -> None:
        nonlocal token
        seq = SeqInput([token], at, blocks, state_slot=slot)
        token = int(runner.logits(runner.forward([seq])[-1:]).argmax())

    step(c)  # warm-up
    times = []
    for j in range(steps):
        t0 = time.perf_counter()
        step(c + 1 + j)
        times.append(time.perf_counter() - t0)
    kinds: Kinds = {}
    removers = _hooks(runner.model, kinds)
    try:
        t0 = time.perf_counter()
        step(c + 1)  # the profile: one more step, with hooks
        total = time.perf_counter() - t0
    finally:
        for r in removers:
            r()
    kinds["rest"] = max(0.0, total - sum(kinds.values()))
    ms = statistics.median(times) * 1e3
    return {
        "step_ms": ms,
        "tok_s": 1e3 / ms,
        "times_ms": [t * 1e3 for t in times],
        "profile_ms": {k: v * 1e3 for k, v in kinds.items()},
    }


def run(args: argparse.Namespace) -> int:
    contexts = _contexts(args.contexts)
    results = [_measure(p, contexts, args) for p in [args.model, *args.peer]]
    base = results[0]["contexts"]
    rows = []
    for r in results:
        first = r["contexts"][contexts[0]]["step_ms"]
        for c in contexts:
            x = r["contexts"][c]
            prof = x["profile_ms"]
            rows.append([
                r["model"], c, round(x["step_ms"], 2), round(x["tok_s"], 1),
                round(x["step_ms"] / first, 2), round(x["step_ms"] / base[c]["step_ms"], 2),
                *(round(prof.get(k, 0.0), 2) for k in ("attention", "linear attention", "mlp",
                                                      "rest")),
            ])  # fmt: skip
    print_table(
        ["model", "context", "step ms", "tok/s", "vs first ctx", "vs --model",
         "attn ms", "linear ms", "mlp ms", "rest ms"],
        rows,
    )  # fmt: skip
    print(
        "'vs --model': the peer's step time over --model's at that context; contexts laid in "
        f"the KV cache uncomputed; median of {args.steps} steps; profile: one more step"
    )
    write_json(args.json, {"bench": "long-decode", "args": vars(args) | {"func": None},
                           "results": results})  # fmt: skip
    return 0
