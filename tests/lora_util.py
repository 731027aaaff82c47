"""Helpers for the LoRA tests: run prompts with adapters, read logprobs."""

from __future__ import annotations

import torch

from hetserve.core.request import NewRequest
from hetserve.testing.tiny_lora import write_random_adapter

__all__ = ["prompt_logprobs", "run", "sample_logprobs", "write_random_adapter"]


def run(engine, prompts, params, loras) -> list:
    """Each prompt as its own request (adapter name or None), all added before any step, so
    they share the engine's batches; the finished outputs in order."""
    ids = []
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        rid = f"r{len(engine.parents)}-{i}-{id(prompt)}"
        engine.enqueue(engine.validate(NewRequest(rid, prompt, params, lora=lora)), stream=False)
        ids.append(rid)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            done[out.request_id] = out
        engine.check_integrity()
    return [done[rid] for rid in ids]


def prompt_logprobs(out) -> torch.Tensor:
    """Logprob of every prompt token after the first (needs prompt_logprobs >= 0)."""
    pairs = zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:], strict=True)
    return torch.tensor([lp[t].logprob for lp, t in pairs])


def sample_logprobs(out) -> torch.Tensor:
    c = out.outputs[0]
    return torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
