"""`hetserve bench NAME`: each benchmark module registers one subcommand here.

Every benchmark prints a table, writes JSON with --json/--result-file, and reports ratios against
a peer or a physical limit measured in the same run.
"""

from __future__ import annotations

import functools
import importlib

BENCH_MODULES: list[str] = [
    "hetserve.bench.generate",
    "hetserve.bench.throughput",
    "hetserve.bench.prefix",
    "hetserve.bench.serve.cli",  # load-test an OpenAI-compatible server
    "hetserve.bench.soak.cli",  # mixed and hostile load; the server must stay whole
    "hetserve.bench.store",
    "hetserve.bench.moe_kernel",
    "hetserve.bench.kernel_ceiling",  # experts backends cache-resident vs cold, per probe
    "hetserve.bench.decode",
    "hetserve.bench.deferral",  # expert deferral d = 0, 1, 2: decode tok/s and KL vs d = 0
    "hetserve.bench.hybrid",  # hybrid decode/prefill: graphs, gpu-experts, deferral, offload peer
    "hetserve.bench.long_decode",  # decode steps at long contexts vs a peer, with a profile
    "hetserve.bench.prefill",  # prompt tokens/s vs llama.cpp, transformers and the peaks
    "hetserve.bench.handoff",  # prefill -> decode hand-off paths side by side
    "hetserve.bench.conductor",  # the Conductor's cost per request
    "hetserve.bench.finetune",  # LoRA training vs transformers + PEFT
    "hetserve.bench.experts_backward",  # the native experts backward vs torch's, GEMM peak
    "hetserve.bench.lora",  # what serving LoRA adapters costs in a batch
    "hetserve.bench.health",  # /health latency while the server takes maximal bodies
    "hetserve.bench.load",  # load seconds, resident and peak memory per format vs llama.cpp
    "hetserve.bench.speculative",  # decode with and without ngram drafts, the cost of drafts
]


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (each prints a table and writes JSON)")
    bench_sub = p.add_subparsers(dest="bench", metavar="BENCH")
    bench_sub.required = True
    for name in BENCH_MODULES:
        importlib.import_module(name).register(bench_sub)
    for bench in bench_sub.choices.values():
        bench.set_defaults(func=functools.partial(_run, bench.get_default("func")))


def _run(run, args) -> int:
    """Every bench writes its --json after the work: a path it cannot write there (a
    directory, a file where its directory should be) is refused before the work, not after."""
    from hetserve.entrypoints import check_output

    check_output(getattr(args, "json", None), "--json", make_parent=True)
    return run(args)
