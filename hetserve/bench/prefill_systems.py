"""The systems `bench prefill` times, each behind one function: load, warm up, time one prompt
per length (best of repeats), free. A system that cannot run raises `Unavailable` with the
reason, which the report prints in its row.

- hetserve under a placement preset (all-int8, hybrid, device = fp32), on the HF checkpoint or
  on the GGUF llama.cpp reads (its experts in their GGUF type); a `max_tokens=1` request with
  the prefix cache off: prompt tokens / wall time (one sampled token on top, negligible);
- llama.cpp (llama-cpp-python) on a GGUF of the same weights: `Llama.eval` of the prompt after
  `reset` (its prompt processing, logits of the last token only);
- transformers fp32: one `forward` of the prompt (`logits_to_keep=1`, no cache kept).

The caller collects garbage between systems, so one system's weights are gone before the next
loads.

Also the model's arithmetic per prompt (`prompt_ops`): what every row is divided by to read as a
fraction of the machine's arithmetic peak.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hetserve.bench.common import Unavailable
from hetserve.bench.decode_llamacpp import import_llama

__all__ = ["Unavailable", "import_llama", "prompt_ops"]


def _best_rate(run: Callable[[list[int]], object], prompts: dict[int, list[int]],
               repeats: int) -> dict[int, float]:  # fmt: skip
    rates = {}
    for n, ids in prompts.items():
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            run(ids)
            best = min(best, time.perf_counter() - t0)
        rates[n] = n / best
    return rates


def hetserve_rates(args, prompts: dict[int, list[int]], placement: str, model: str,
                   activation_bits: int = 16) -> dict[int, float]:  # fmt: skip
    from hetserve import LLM, SamplingParams
    from hetserve.errors import HetserveError

    longest = max(prompts)
    opts: dict = {"cpu_threads": args.threads} if args.threads else {}
    if activation_bits != 16:
        opts["activation_bits"] = activation_bits
    if args.max_num_batched_tokens:
        opts["max_num_batched_tokens"] = args.max_num_batched_tokens
    try:
        llm = LLM(model, placement=placement, max_model_len=longest + 8,
                  enable_prefix_caching=False, **opts)  # fmt: skip
    except HetserveError as exc:
        raise Unavailable(str(exc)) from None
    params = SamplingParams(max_tokens=1, temperature=0)

    def run(ids: list[int]) -> None:
        llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)

    run(prompts[min(prompts)][:64])  # warm-up: kernels built, pools allocated
    return _best_rate(run, prompts, args.repeats)  # its weights go with this frame (gc: caller)


def llamacpp_rates(args, prompts: dict[int, list[int]], threads: int) -> dict[int, float]:
    from hetserve.bench import decode_llamacpp

    llama = import_llama()
    path = decode_llamacpp.gguf_path(args, threads)
    if path is None:
        raise Unavailable("no GGUF (pass --gguf FILE or --llama-cpp-src DIR to convert one)")
    longest = max(prompts)
    llm = llama(
        model_path=str(path),
        n_ctx=longest + 16,
        n_batch=min(longest, args.llama_batch),
        n_ubatch=min(longest, args.llama_ubatch),
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )

    def run(ids: list[int]) -> None:
        llm.reset()  # no prompt reuse: every run processes the whole prompt
        llm.eval(ids)

    try:
        run(prompts[min(prompts)][:64])
        return _best_rate(run, prompts, args.repeats)
    finally:
        llm.close()


def hetserve_gguf_rates(args, prompts: dict[int, list[int]], threads: int) -> dict[int, float]:
    """hetserve on the GGUF llama.cpp reads (CPU-only: the all-int8 preset, which serves the
    experts from their GGUF numbers)."""
    import torch

    from hetserve.bench import decode_llamacpp

    path = decode_llamacpp.gguf_path(args, threads)
    if path is None:
        raise Unavailable("no GGUF (pass --gguf FILE or --llama-cpp-src DIR to convert one)")
    placement = "hybrid" if torch.cuda.is_available() else "all-int8"
    return hetserve_rates(args, prompts, placement, str(path))


def transformers_rates(args, prompts: dict[int, list[int]]) -> dict[int, float]:
    import torch

    try:
        import transformers
    except ImportError as exc:
        raise Unavailable(f"transformers does not import: {exc}") from None
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    keep = {n: ids for n, ids in prompts.items() if n <= args.hf_max_len}
    if not keep:
        raise Unavailable(f"every prompt is longer than --hf-max-len {args.hf_max_len}")

    def run(ids: list[int]) -> None:
        with torch.no_grad():
            model(torch.tensor([ids]), use_cache=False, logits_to_keep=1)

    run(prompts[min(prompts)][:64])
    return _best_rate(run, keep, args.repeats)


# --- the model's arithmetic ---------------------------------------------------------------------


def prompt_ops(cfg: dict, n: int) -> dict[str, int] | None:
    """Operations (a multiply-add is 2) of one causal prompt of n tokens through a GQA MoE or
    dense model, by part: routed experts, other linears (attention projections, router, shared
    experts, dense MLPs, the last token's lm_head) and attention itself (causal: n(n+1)/2 query-
    key pairs per head). None for MLA attention, whose shapes this does not model."""
    from hetserve.bench.weight_bytes import moe_layer_count

    if "kv_lora_rank" in cfg:
        return None
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    nq, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", 1)
    moe = moe_layer_count(cfg) if cfg.get("num_experts_per_tok") else 0
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    inter = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size", 0)
    top_k = cfg.get("num_experts_per_tok") or 0
    shared = cfg.get("shared_expert_intermediate_size") or 0
    routed = moe * top_k * 3 * h * inter
    proj = layers * h * (2 * nq * hd + 2 * nkv * hd)
    dense = moe * (h * experts + 3 * h * shared) + (layers - moe) * 3 * h * cfg.get(
        "intermediate_size", 0
    )
    attention = layers * nq * 2 * hd * (n * (n + 1) // 2)
    lm_head = cfg["vocab_size"] * h
    return {
        "routed_experts": 2 * n * routed,
        "linears": 2 * (n * (proj + dense) + lm_head),
        "attention": 2 * attention,
    }
