"""Prometheus metrics of one server: request gauges, KV usage, prefix-cache hit rate,
TTFT / inter-token / end-to-end latency histograms and token counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    def __init__(self, engine) -> None:
        self.engine = engine
        r = self.registry = CollectorRegistry()
        self.running = Gauge("hetserve_num_requests_running", "requests running", registry=r)
        self.waiting = Gauge("hetserve_num_requests_waiting", "requests waiting", registry=r)
        self.kv_used = Gauge("hetserve_kv_blocks_used", "KV blocks in use", registry=r)
        self.kv_total = Gauge("hetserve_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.hit_rate = Gauge(
            "hetserve_prefix_cache_hit_rate", "prefix-cache block hits / queries", registry=r
        )
        self.preemptions = Gauge("hetserve_preemptions", "preemptions so far", registry=r)
        self.ttft = Histogram(
            "hetserve_time_to_first_token_seconds", "TTFT", buckets=_LATENCY, registry=r
        )
        self.itl = Histogram(
            "hetserve_inter_token_latency_seconds",
            "time between outputs",
            buckets=_LATENCY,
            registry=r,
        )
        self.e2e = Histogram(
            "hetserve_e2e_request_latency_seconds",
            "end-to-end latency",
            buckets=_LATENCY,
            registry=r,
        )
        self.prompt_tokens = Counter("hetserve_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "hetserve_generation_tokens", "generated tokens", registry=r
        )
        self.requests = Counter(
            "hetserve_requests", "finished requests", ["finish_reason"], registry=r
        )
        engine.observers.append(self.observe)

    def observe(self, request_id, out, timing) -> None:
        # Called on the engine thread once per output of a request.
        times = timing.token_times
        if len(times) == 1:
            self.ttft.observe(times[0] - timing.arrival)
        else:
            self.itl.observe(times[-1] - times[-2])
        if out.finished:
            self.e2e.observe(timing.last_token - timing.arrival)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            for c in out.outputs:
                self.generation_tokens.inc(len(c.token_ids))
                self.requests.labels(c.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        s = self.engine.stats()
        self.running.set(s["running"])
        self.waiting.set(s["waiting"])
        self.kv_used.set(s["kv_blocks_used"])
        self.kv_total.set(s["kv_blocks_total"])
        self.hit_rate.set(s["prefix_hits"] / s["prefix_queries"] if s["prefix_queries"] else 0)
        self.preemptions.set(s["preemptions"])
        return generate_latest(self.registry)
