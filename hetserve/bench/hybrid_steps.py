"""Where a hybrid decode step's time goes, for `hetserve bench hybrid`: the routed experts' host
calls and the CPU kernels inside them, timed per step (through the graphs and eagerly, at each
batch size), and torch.profiler's operator tables of a few decode steps.

Who calls it: bench/hybrid.py's `run`, on an engine it loaded. Each measurement wraps the decode
backends' `forward` and puts them back after it, also when it fails.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


def _decode_backends(llm) -> Iterator[tuple[object, object | None]]:
    """Each layer's decode backend of the routed experts, and the CPU backend inside it where
    it is a DeviceBridge (else None)."""
    for _, experts in llm.model.routed_experts():
        backend = (experts._phase_backends or {}).get("decode")
        if backend is not None:
            yield backend, getattr(backend, "inner", None)


@contextmanager
def _modes(runner) -> Iterator[Iterator[str]]:
    """The runner's decode modes, "graphs" (where it has them) then "eager", each set on the
    runner as it is handed out; its graphs put back on leaving, also on failure."""
    graphs = runner.graphs

    def each() -> Iterator[str]:
        for mode in ("graphs", "eager") if graphs is not None else ("eager",):
            runner.graphs = graphs if mode == "graphs" else None
            yield mode

    try:
        yield each()
    finally:
        runner.graphs = graphs


def _prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


class _Timed:
    """Wraps a backend's `forward` (an instance attribute shadowing the method) and sums the
    seconds spent in it; `undo` puts the method back."""

    def __init__(self, backend) -> None:
        self.backend, self.seconds = backend, 0.0
        inner = backend.forward

        def forward(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        backend.forward = forward

    def undo(self) -> None:
        del self.backend.forward


def decode_breakdown(llm, cfg: dict, prompts: list[list[int]], tokens: int) -> dict:
    """Where a decode step's time goes (len(prompts) streams): the routed experts' host calls
    (the bridge to the CPU, its waits and copies included, where the experts sit elsewhere than
    the activations) and, inside them, the CPU experts kernels; per step, and the kernels' read
    rate at batch 1 (the step's expert bytes over the kernels' own time). What tells a slow
    kernel from an overhead around it when the experts read a small share of the bandwidth."""
    import torch

    from hetserve import SamplingParams
    from hetserve.bench.weight_bytes import expert_bytes_per_token

    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=params)  # warm (graphs captured)
    outer, inner = [], []
    for backend, kernels in _decode_backends(llm):
        outer.append(_Timed(backend))
        if kernels is not None:  # DeviceBridge: the CPU kernels inside
            inner.append(_Timed(kernels))
    runner = llm.engine.runner
    forward = runner.forward
    timers = outer + inner
    step = {"seconds": 0.0, "steps": 0, "host": 0.0, "kernels": 0.0}

    def timed_forward(seqs):  # only decode steps count, the experts' time inside them too
        if not all(len(s.token_ids) == 1 for s in seqs):
            return forward(seqs)
        before = [t.seconds for t in timers]
        t0 = time.perf_counter()
        try:
            out = forward(seqs)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)  # the step's queued GPU work too
            return out
        finally:
            step["seconds"] += time.perf_counter() - t0
            step["steps"] += 1
            spent = [t.seconds - b for t, b in zip(timers, before, strict=True)]
            step["host"] += sum(spent[: len(outer)])
            step["kernels"] += sum(spent[len(outer) :] if inner else spent)

    runner.forward = timed_forward
    try:
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
    finally:
        del runner.forward
        for t in timers:
            t.undo()
    n = max(step["steps"], 1)
    host, kernels, per_step = step["host"] / n, step["kernels"] / n, step["seconds"] / n
    nbytes = expert_bytes_per_token(cfg)["bytes_per_token"]
    return {
        "batch": len(prompts),
        "step_ms": 1e3 * per_step,
        "experts_host_calls_ms": 1e3 * host,
        "experts_kernels_ms": 1e3 * kernels,
        "rest_ms": 1e3 * (per_step - host),
        "kernels_gbps": nbytes / kernels / 1e9 if kernels > 0 and len(prompts) == 1 else None,
    }


def breakdowns(llm, cfg: dict, args, batches: list[int], vocab: int) -> list[dict]:
    """decode_breakdown at every batch size, through the graphs and eagerly (where graphs
    exist)."""
    out = []
    with _modes(llm.engine.runner) as modes:
        for mode in modes:
            for b in batches:
                prompts = _prompts(vocab, b, args.prompt_len)
                out.append({"mode": mode, **decode_breakdown(llm, cfg, prompts, args.tokens)})
    return out


def profile_table(llm, args, batches: list[int], vocab: int, path: str) -> None:
    """torch.profiler's operator table (CPU and CUDA time) of a few decode steps at each batch
    size, through the graphs and eagerly, written to `path` (text)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hetserve import SamplingParams

    labelled = []  # the experts' host calls and the CPU kernels inside them, named in the table
    for backend, kernels in _decode_backends(llm):
        labelled.append(_Labelled(backend, "experts host call"))
        if kernels is not None:
            labelled.append(_Labelled(kernels, "experts CPU kernels"))
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0, ignore_eos=True)
    try:
        with _modes(llm.engine.runner) as modes, open(path, "w") as f:
            for mode in modes:
                for b in batches:
                    prompts = _prompts(vocab, b, args.prompt_len)
                    llm.generate(prompt_token_ids=prompts, sampling_params=params)  # warm
                    with profile(activities=activities) as prof:
                        llm.generate(prompt_token_ids=prompts, sampling_params=params)
                    rows = prof.key_averages()
                    table = rows.table(sort_by="self_cpu_time_total", row_limit=25)
                    f.write(f"== {mode}, batch {b}, 8 tokens (prompt {args.prompt_len})\n")
                    f.write(f"{table}\n")
                    if torch.cuda.is_available():
                        by_cuda = rows.table(sort_by="self_cuda_time_total", row_limit=25)
                        f.write(f"-- by CUDA time\n{by_cuda}\n")
    finally:
        for t in labelled:
            t.undo()


class _Labelled:
    """Wraps a backend's `forward` in a profiler range named `name`; `undo` puts it back."""

    def __init__(self, backend, name: str) -> None:
        from torch.profiler import record_function

        self.backend, inner = backend, backend.forward

        def forward(*a, **k):
            with record_function(name):
                return inner(*a, **k)

        backend.forward = forward

    def undo(self) -> None:
        del self.backend.forward
