"""A snapshot of the engine between steps (what the server's metrics read), and the periodic
log line a server writes from such snapshots."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine between steps: what the server's metrics read. The num_*
    totals only grow."""

    num_running: int
    num_waiting: int
    num_pages: int
    num_pages_used: int  # held by requests, transfers or shared cache entries (not evictable)
    capacity_tokens: int  # tokens the KV pool holds
    kv_capacity_ratio: float  # tokens per byte against a pool in the activation dtype
    kv_cache: dict[str, str]  # its dtype and FP8 scale source (KVPool.describe)
    num_preemptions: int
    num_integrity_failures: int  # requests failed by the KV-cache integrity check
    num_bookkeeping_errors: int  # contradictions found by check_integrity or a page free
    num_pages_held: int = 0  # pages kept for a transfer (prefill leases, loads ending)
    num_kv_loads: int = 0  # prompts whose KV came from a prefill worker
    num_kv_load_failures: int = 0  # reads that failed, timed out or failed their checksum
    num_kv_leases_expired: int = 0  # prefill pages freed without the decode side's read
    kv_bytes_loaded: int = 0
    num_pages_cached: int = 0  # pages the prefix cache maps (evictable or shared)
    prefix_cache_queries: int = 0  # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found there
    kv_check_kl: float | None = None  # a quantized cache's start-up check (worker.kv_check)
    kv_check_top1: float | None = None
    num_kv_slow_routes: int = 0  # prefill workers whose probe read was slow (disagg.probe)
    num_kv_mapped_loads: int = 0  # KV loads copied from a pool mapped here (disagg.direct)
    num_prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits not; recomputes again)
    num_generation_tokens: int = 0  # tokens sampled and recorded


def snapshot(engine) -> EngineStats:
    """engine's (an LLMEngine's) stats now: call it between its steps, on its thread."""
    pool, kv, t = engine.worker.pool, engine.scheduler.kv, engine.connector.stats()
    scheduler, cache, checked = engine.scheduler, kv.cache, engine.worker.kv_check
    return EngineStats(
        len(scheduler.running), len(scheduler.waiting), pool.num_pages,
        pool.num_pages - kv.num_free, pool.capacity_tokens, engine.worker.kv_capacity_ratio,
        pool.describe(), engine.num_preemptions, engine.num_integrity_failures,
        engine.num_bookkeeping_errors + (cache.num_stale if cache else 0), kv.num_held,
        t.num_loads, t.num_load_failures, t.num_leases_expired, t.bytes_loaded,
        cache.num_cached if cache else 0, kv.num_cache_queries, kv.num_cache_hits,
        checked and checked.kl_mean, checked and checked.top1_agree, t.num_slow_routes,
        t.num_mapped_loads, engine.num_prompt_tokens, engine.num_generation_tokens)


class StatsLog:
    """The line a server logs every `interval` seconds while it has work, as vLLM's do: prompt
    and generation tokens a second over the interval, requests running and waiting, the share
    of KV pages in use, and the prefix cache's hit rate over the interval's admissions."""

    def __init__(self, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval, self.clock = interval, clock
        self._last: tuple[float, EngineStats] | None = None

    def line(self, stats: EngineStats) -> str | None:
        """The line due now (None before `interval` has passed since the last one, and for an
        interval in which nothing ran and nothing waits)."""
        now = self.clock()
        if self._last is None:
            self._last = (now, stats)
            return None
        then, before = self._last
        if now - then < self.interval:
            return None
        self._last = (now, stats)
        prompt = stats.num_prompt_tokens - before.num_prompt_tokens
        generated = stats.num_generation_tokens - before.num_generation_tokens
        if not (prompt or generated or stats.num_running or stats.num_waiting):
            return None
        queries = stats.prefix_cache_queries - before.prefix_cache_queries
        hits = stats.prefix_cache_hits - before.prefix_cache_hits
        seconds = now - then
        return (f"prompt {prompt / seconds:.1f} tokens/s, generation {generated / seconds:.1f} "
                f"tokens/s, running {stats.num_running}, waiting {stats.num_waiting}, KV cache "
                f"{100 * stats.num_pages_used / max(stats.num_pages, 1):.1f} % in use, "
                f"prefix cache hit rate "
                + (f"{100 * hits / queries:.1f} %" if queries else "- (no prompts admitted)"))
