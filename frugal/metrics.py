"""Prometheus metrics of one engine (prometheus-client, a registry of its own)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from frugal.engine.stats import EngineStats
    from frugal.request import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


class Metrics:
    """Counters, gauges and latency histograms; updated by the engine loop, thread-safe."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels.keys(), registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels.keys(), registry=r).labels(**labels)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels.keys(), buckets=_LATENCY_BUCKETS,
                             registry=r).labels(**labels)

        self.running = gauge("frugal_num_requests_running", "Requests in the running batch")
        self.waiting = gauge("frugal_num_requests_waiting", "Requests waiting to be scheduled")
        self.pages_used = gauge("frugal_kv_cache_pages_used", "KV cache pages in use")
        self.pages_total = gauge("frugal_kv_cache_pages_total", "KV cache pages in the pool")
        self.kv_tokens = gauge("frugal_kv_cache_capacity_tokens", "Tokens the KV pool holds")
        self.kv_ratio = gauge("frugal_kv_cache_capacity_ratio",
                              "Tokens the KV pool holds per byte, relative to a pool in the "
                              "model's activation dtype (FP8 KV under bf16: 2)")
        self.kv_info = Gauge("frugal_kv_cache_info", "KV cache dtype and FP8 scale source (1)",
                             ["model_name", "kv_cache_dtype", "kv_scales"], registry=r)
        self.kv_check_kl = gauge("frugal_kv_cache_check_kl",
                                 "Start-up check of a quantized KV cache: mean KL of the "
                                 "next-token distribution from the unquantized cache's")
        self.kv_check_top1 = gauge("frugal_kv_cache_check_top1_agreement",
                                   "Start-up check of a quantized KV cache: share of positions "
                                   "whose top-1 token is the unquantized cache's")
        self.prompt_tokens = counter("frugal_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("frugal_generation_tokens", "Generated tokens")
        self.preemptions = counter("frugal_preemptions", "Requests preempted for KV space")
        self._finished = Counter("frugal_requests_finished", "Finished requests by reason",
                                 ["model_name", "finish_reason"], registry=r)
        self.model_name = model_name
        self.aborted = counter("frugal_requests_aborted", "Requests aborted (e.g. disconnects)")
        self.errored = counter("frugal_requests_errored", "Requests failed by an engine error")
        self.kv_integrity_failures = counter(
            "frugal_kv_integrity_failures",
            "Requests aborted because their KV pages failed the integrity check")
        self.bookkeeping_checks = counter(
            "frugal_kv_bookkeeping_checks",
            "Walks of the page bookkeeping (free + used == total, refcounts, tags) when idle")
        self.bookkeeping_errors = counter(
            "frugal_kv_bookkeeping_errors",
            "Contradictions those walks or a page free found (a bug; the pages were recounted)")
        self.pages_held = gauge("frugal_kv_cache_pages_held",
                                "KV pages held for a transfer (a prefill's until the decode "
                                "side has read them)")
        self.kv_loads = counter("frugal_kv_transfer_loads",
                                "Prompts whose KV came from a prefill worker, checksums intact")
        self.kv_load_failures = counter(
            "frugal_kv_transfer_failures",
            "KV reads from a prefill worker that failed, timed out or brought a page whose "
            "checksum differs (each failed its request alone)")
        self.kv_leases_expired = counter(
            "frugal_kv_transfer_leases_expired",
            "Prefills whose pages were freed unread when their lease ran out")
        self.kv_bytes = counter("frugal_kv_transfer_bytes", "KV bytes read from prefill workers")
        self.kv_mapped_loads = counter(
            "frugal_kv_transfer_mapped_loads",
            "Of the KV loads, those copied from a prefill worker's pool mapped into this worker "
            "(one host: CUDA IPC or shared memory) rather than read over NIXL")
        self.kv_slow_routes = counter(
            "frugal_kv_transfer_slow_routes",
            "Prefill workers whose hand-offs go over TCP or through host memory (their probe "
            "read at first contact)")
        self.pages_cached = gauge("frugal_kv_cache_pages_cached",
                                  "KV pages the prefix cache maps (shared, or evictable)")
        self.cache_queries = counter("frugal_prefix_cache_queries",
                                     "Prompt tokens looked up in the prefix cache")
        self.cache_hits = counter("frugal_prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache (their prefill skipped)")
        self.ttft = histogram("frugal_time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("frugal_inter_token_latency_seconds", "Time between output tokens")
        self.e2e = histogram("frugal_e2e_request_latency_seconds", "Arrival to last token")

    def watch(self, stats: EngineStats) -> None:
        """Start from an engine's snapshot: the pool's size, and its totals so far (which
        count as already seen)."""
        self.pages_total.set(stats.num_pages)
        self.kv_tokens.set(stats.capacity_tokens)
        self.kv_ratio.set(stats.kv_capacity_ratio)
        self.kv_info.labels(model_name=self.model_name, **stats.kv_cache).set(1)
        if stats.kv_check_kl is not None:
            self.kv_check_kl.set(stats.kv_check_kl)
            self.kv_check_top1.set(stats.kv_check_top1)
        self._seen = {name: getattr(stats, name) for name, _ in self._totals()}
        self.update(stats)

    def update(self, stats: EngineStats) -> None:
        """Gauges from a snapshot; the counters of engine totals by what they grew since."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.pages_used.set(stats.num_pages_used)
        self.pages_held.set(stats.num_pages_held)
        self.pages_cached.set(stats.num_pages_cached)
        for name, counter in self._totals():
            total = getattr(stats, name)
            counter.inc(total - self._seen[name])
            self._seen[name] = total

    def _totals(self) -> list[tuple[str, Counter]]:
        return [("num_preemptions", self.preemptions),
                ("num_integrity_failures", self.kv_integrity_failures),
                ("num_bookkeeping_errors", self.bookkeeping_errors),
                ("num_kv_loads", self.kv_loads), ("num_kv_load_failures", self.kv_load_failures),
                ("num_kv_leases_expired", self.kv_leases_expired),
                ("kv_bytes_loaded", self.kv_bytes),
                ("num_kv_slow_routes", self.kv_slow_routes),
                ("num_kv_mapped_loads", self.kv_mapped_loads),
                ("prefix_cache_queries", self.cache_queries),
                ("prefix_cache_hits", self.cache_hits)]

    def observe(self, output: RequestOutput, arrival: float, last_token: float | None,
                now: float, num_prompt_tokens: int) -> None:
        """A request's output (new tokens) handed over at `now`; last_token: when its previous
        one was, None before its first."""
        completion = output.outputs[0]
        if not completion.token_ids:
            return
        if last_token is None:
            self.ttft.observe(now - arrival)
        else:
            self.itl.observe(now - last_token)
        self.generation_tokens.inc(len(completion.token_ids))
        if output.finished:
            self.e2e.observe(now - arrival)
            self.prompt_tokens.inc(num_prompt_tokens)
            self._finished.labels(model_name=self.model_name,
                                  finish_reason=completion.finish_reason).inc()
