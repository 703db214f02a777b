"""A snapshot of the engine between steps (what the server's metrics read)."""

from __future__ import annotations

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
        t.num_mapped_loads)
