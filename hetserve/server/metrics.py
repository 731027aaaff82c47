"""Prometheus metrics of one server, under hetserve's names and under the `vllm:` names that
existing Grafana dashboards chart (same meaning, `model_name` label), plus the process
collector (`process_resident_memory_bytes`, ...).

Engine state (requests, KV, prefix cache, preemptions) is read from `EngineStats` at scrape
time by a collector; latencies are observed on the engine thread as outputs are produced, with
TTFT and end-to-end latency measured from the request's arrival at the HTTP server.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.utils import floatToGoString

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class _EngineCollector:
    """Engine gauges and counters, read from one stats snapshot per scrape."""

    def __init__(self, engine, model_name: str, block_size: int) -> None:
        self.engine = engine
        self.model = model_name
        self.block_size = block_size

    def collect(self):
        s = self.engine.stats()
        m = [self.model]

        def gauge(name, doc, value, labels=()):
            g = GaugeMetricFamily(name, doc, labels=list(labels))
            g.add_metric(m[: len(labels)], value) if labels else g.add_metric([], value)
            return g

        def counter(name, doc, value, labels=()):
            c = CounterMetricFamily(name, doc, labels=list(labels))
            c.add_metric(m[: len(labels)], value) if labels else c.add_metric([], value)
            return c

        yield gauge("hetserve_num_requests_running", "requests running", s.num_running)
        yield gauge("hetserve_num_requests_waiting", "requests waiting", s.num_waiting)
        yield gauge("hetserve_kv_blocks_used", "KV blocks in use", s.kv_blocks_used)
        yield gauge("hetserve_kv_blocks_total", "KV blocks in the pool", s.kv_blocks_total)
        yield gauge(
            "hetserve_prefix_cache_hit_rate", "prefix-cache block hits / queries", s.prefix_hit_rate
        )
        yield counter("hetserve_preemptions", "preemptions so far", s.preemptions)
        yield counter(
            "hetserve_layer_slices",
            "prompt chunks run a few decoder layers a step beside decodes",
            s.layer_slices,
        )
        yield counter(
            "hetserve_failed_requests", "requests failed inside the engine", s.failed_requests
        )
        name = ("model_name",)
        yield gauge("vllm:num_requests_running", "requests running", s.num_running, name)
        yield gauge("vllm:num_requests_waiting", "requests waiting", s.num_waiting, name)
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage (0..1)", s.kv_usage, name)
        bs = self.block_size
        yield counter(
            "vllm:prefix_cache_queries",
            "prefix cache queries, in tokens",
            s.prefix_queries * bs,
            name,
        )
        yield counter(
            "vllm:prefix_cache_hits", "prefix cache hits, in tokens", s.prefix_hits * bs, name
        )
        yield counter("vllm:num_preemptions", "preemptions so far", s.preemptions, name)
        if getattr(self.engine.config, "speculative", None) is not None:
            yield from _spec_metrics(s, name, counter)
        yield from _step_metrics(s.step_kinds)
        if s.tiers is not None:
            yield from _tier_metrics(s)


def _spec_metrics(s, name, counter):
    """Speculative decoding: vLLM's counters (decodes that checked drafts, drafts checked,
    drafts that held) and the acceptance rate."""
    for vllm, ours, doc, value in (
        ("num_drafts", "drafts", "decodes that checked drafts", s.spec_drafts),
        ("num_draft_tokens", "draft_tokens", "draft tokens checked", s.spec_draft_tokens),
        ("num_accepted_tokens", "accepted_tokens", "draft tokens that held",
         s.spec_accepted_tokens),
    ):  # fmt: skip
        yield counter(f"hetserve_spec_decode_{ours}", doc, value)
        yield counter(f"vllm:spec_decode_{vllm}", doc, value, name)
    g = GaugeMetricFamily(
        "hetserve_spec_decode_acceptance_rate", "draft tokens that held / draft tokens checked"
    )
    g.add_metric([], s.spec_acceptance_rate)
    yield g


def _step_metrics(kinds):
    """Engine steps by kind (decode, mixed, prefill): wall time, each prompt chunk's tokens,
    and the step-time model's error (measured / predicted) where it sized chunks."""
    seconds = HistogramMetricFamily(
        "hetserve_step_seconds", "engine step wall time, by kind", labels=["kind"]
    )
    chunks = HistogramMetricFamily(
        "hetserve_prefill_chunk_tokens",
        "prompt tokens of each chunk, by step kind",
        labels=["kind"],
    )
    fit = GaugeMetricFamily(
        "hetserve_step_time_fit_ratio",
        "measured / predicted step time (mixed and prefill steps), by kind",
        labels=["kind"],
    )
    for kind, k in kinds.items():
        for family, hist in ((seconds, k.seconds), (chunks, k.chunk_tokens)):
            family.add_metric([kind], _buckets(hist), hist.total)
        if k.fit_ratio is not None:
            fit.add_metric([kind], k.fit_ratio)
    yield seconds
    yield chunks
    yield fit


def _buckets(hist) -> list[tuple[str, int]]:
    """Prometheus' cumulative buckets, +Inf last."""
    out, total = [], 0
    for bound, n in zip((*hist.bounds, float("inf")), hist.counts, strict=True):
        total += n
        out.append((floatToGoString(bound), total))
    return out


def _tier_metrics(s):
    """The KV tiers: block-weighted hits per tier (device included), what moved, what was
    skipped (recompute predicted faster), missed (gone or corrupt) or shed (save queue full)."""
    t = s.tiers
    hits = {"device": 0, **s.prefix_hits_by_tier}
    c = CounterMetricFamily(
        "hetserve_kv_tier_hit_blocks",
        "prefix blocks found, by the tier they came from",
        labels=["tier"],
    )
    r = GaugeMetricFamily(
        "hetserve_kv_tier_hit_rate", "hit blocks / looked-up blocks, by tier", labels=["tier"]
    )
    for tier, n in hits.items():
        c.add_metric([tier], n)
        r.add_metric([tier], n / s.prefix_queries if s.prefix_queries else 0.0)
    yield c
    yield r
    plain = (
        ("hetserve_kv_tier_lookup_blocks", "prompt blocks looked up", s.prefix_queries),
        ("hetserve_kv_tier_loads", "loads from the KV store", t.loads),
        ("hetserve_kv_tier_load_seconds", "time spent in loads", t.load_seconds),
        ("hetserve_kv_tier_load_bytes", "bytes loaded from the KV store", t.load_bytes),
        ("hetserve_kv_tier_save_bytes", "bytes saved to the KV store", t.save_bytes),
        ("hetserve_kv_tier_saved_blocks", "blocks saved to the KV store", t.saved_blocks),
        ("hetserve_kv_tier_skipped_blocks", "found but recomputed (cheaper)", t.skipped_blocks),
        ("hetserve_kv_tier_missed_blocks", "found but gone or corrupt at read", t.missed_blocks),
        ("hetserve_kv_tier_shed_saves", "saves dropped from a full queue", t.shed_saves),
        ("hetserve_kv_tier_failed_saves", "blocks a save failed", t.save_failed_blocks),
    )
    for metric, doc, value in plain:
        m = CounterMetricFamily(metric, doc)
        m.add_metric([], value)
        yield m
    g = GaugeMetricFamily("hetserve_kv_tier_pending_saves", "blocks waiting to be saved")
    g.add_metric([], t.pending_saves)
    yield g
    yield from _load_fit_metrics(t.load_fit)


def _load_fit_metrics(fits):
    """Each tier's loads as the cost model predicted them and as they happened (whole
    single-tier reads): the reads, and what requests waited for them (a load off the engine
    thread is seen at a step boundary); the ratio is the model's error as a factor."""
    families = (
        ("hetserve_kv_load_predicted_seconds", "predicted read time of loads", "predicted_s"),
        ("hetserve_kv_load_seconds", "measured read time of loads", "measured_s"),
        ("hetserve_kv_load_wait_predicted_seconds", "predicted wait for loads", "predicted_wait_s"),
        ("hetserve_kv_load_wait_seconds", "measured wait for loads", "measured_wait_s"),
    )
    for metric, doc, attr in families:
        m = SummaryMetricFamily(metric, doc, labels=["tier"])
        for tier, fit in fits.items():
            m.add_metric([tier], fit.loads, getattr(fit, attr))
        yield m
    r = GaugeMetricFamily(
        "hetserve_kv_load_fit_ratio",
        "measured / predicted load time, by tier and what is timed (read, wait)",
        labels=["tier", "part"],
    )
    for tier, fit in fits.items():
        for part, ratio in (("read", fit.ratio), ("wait", fit.wait_ratio)):
            if ratio is not None:
                r.add_metric([tier, part], ratio)
    yield r


class _Fixed:
    """A collector of a metric family that never changes (configuration info)."""

    def __init__(self, family) -> None:
        self.family = family

    def collect(self):
        yield self.family


class ServerMetrics:
    def __init__(self, engine, model_name: str = "hetserve") -> None:
        self.engine = engine
        r = self.registry = CollectorRegistry()
        block_size = engine.config.cache.block_size
        r.register(_EngineCollector(engine, model_name, block_size))
        ProcessCollector(registry=r)
        self._hists = {}
        for key, doc in (
            ("time_to_first_token_seconds", "time to first token, from HTTP arrival"),
            ("inter_token_latency_seconds", "time between outputs"),
            ("e2e_request_latency_seconds", "end-to-end latency, from HTTP arrival"),
        ):
            ours = Histogram(f"hetserve_{key}", doc, buckets=_LATENCY, registry=r)
            theirs = Histogram(
                f"vllm:{key}", doc, ["model_name"], buckets=_LATENCY, registry=r
            ).labels(model_name)
            self._hists[key] = (ours, theirs)
        self.prompt_tokens = Counter("hetserve_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "hetserve_generation_tokens", "generated tokens", registry=r
        )
        self.vllm_prompt = Counter(
            "vllm:prompt_tokens", "prompt tokens", ["model_name"], registry=r
        ).labels(model_name)
        self.vllm_generation = Counter(
            "vllm:generation_tokens", "generated tokens", ["model_name"], registry=r
        ).labels(model_name)
        self.requests = Counter(
            "hetserve_requests", "finished requests", ["finish_reason"], registry=r
        )
        self.vllm_success = Counter(
            "vllm:request_success",
            "finished requests",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.model_name = model_name
        self._vllm_request_metrics(r, model_name)
        cache = engine.config.cache
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "the KV cache's configuration (labels); value 1",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype"],
        )
        blocks = engine.stats().kv_blocks_total
        caching = str(getattr(cache, "enable_prefix_caching", True)).lower()
        info.add_metric([str(cache.block_size), str(blocks), caching, "auto"], 1.0)
        r.register(_Fixed(info))
        memory = getattr(engine, "memory", None)
        if memory is not None:  # measured once at start-up (core/memory.py)
            mem = GaugeMetricFamily(
                "hetserve_memory_bytes", "host memory by part at start-up", labels=["part"]
            )
            for part, value in memory.as_metrics().items():
                mem.add_metric([part], float(value))
            r.register(_Fixed(mem))
        engine.observers.append(self.observe)
        if hasattr(engine, "step_observers"):  # an AsyncLLM (tests pass stand-ins)
            engine.step_observers.append(self.iteration_tokens.observe)

    def _vllm_request_metrics(self, r: CollectorRegistry, model: str) -> None:
        """vLLM's per-request histograms that its dashboards chart."""

        def hist(name: str, doc: str, buckets):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(model)

        self.req_prompt = hist("vllm:request_prompt_tokens", "prompt tokens per request", _TOKENS)
        self.req_gen = hist(
            "vllm:request_generation_tokens", "generated tokens per request", _TOKENS
        )
        self.queue_time = hist(
            "vllm:request_queue_time_seconds", "from arrival to first scheduled", _LATENCY
        )
        self.prefill_time = hist(
            "vllm:request_prefill_time_seconds", "from first scheduled to first token", _LATENCY
        )
        self.decode_time = hist(
            "vllm:request_decode_time_seconds", "from first token to last token", _LATENCY
        )
        self.tpot = hist(
            "vllm:time_per_output_token_seconds", "time between output tokens", _LATENCY
        )
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total", "tokens computed per engine step", _TOKENS
        )

    def _observe(self, key: str, value: float) -> None:
        for h in self._hists[key]:
            h.observe(value)

    def observe(self, request_id, out, timing) -> None:
        # Called on the engine thread once per output of a request.
        if out.error is not None:
            self.requests.labels("error").inc()
            return
        times = timing.token_times
        if len(times) == 1:
            self._observe("time_to_first_token_seconds", times[0] - timing.arrival)
        else:
            self._observe("inter_token_latency_seconds", times[-1] - times[-2])
            self.tpot.observe(times[-1] - times[-2])
        if out.finished:
            self._finished(out, timing)

    def _finished(self, out, timing) -> None:
        self._observe("e2e_request_latency_seconds", timing.last_token - timing.arrival)
        n_prompt = len(out.prompt_token_ids)
        self.prompt_tokens.inc(n_prompt)
        self.vllm_prompt.inc(n_prompt)
        generated = sum(len(c.token_ids) for c in out.outputs)
        self.generation_tokens.inc(generated)
        self.vllm_generation.inc(generated)
        # One request, one success (and one TTFT), whatever its n: as vLLM counts them.
        reason = out.outputs[0].finish_reason or "unknown"
        self.requests.labels(reason).inc()
        self.vllm_success.labels(self.model_name, reason).inc()
        self.req_prompt.observe(n_prompt)
        self.req_gen.observe(generated)
        first = timing.first_token or timing.last_token
        scheduled = out.scheduled_time if out.scheduled_time is not None else timing.arrival
        self.queue_time.observe(max(0.0, scheduled - timing.arrival))
        self.prefill_time.observe(max(0.0, first - scheduled))
        self.decode_time.observe(max(0.0, timing.last_token - first))

    def render(self) -> bytes:
        return generate_latest(self.registry)
