"""engine.stats.StatsLog: the server's periodic line from two snapshots, as vLLM logs it."""

from dataclasses import replace

from frugal.engine.stats import EngineStats, StatsLog

IDLE = EngineStats(num_running=0, num_waiting=0, num_pages=200, num_pages_used=0,
                   capacity_tokens=3200, kv_capacity_ratio=1.0, kv_cache={}, num_preemptions=0,
                   num_integrity_failures=0, num_bookkeeping_errors=0)


def test_a_line_every_interval_while_there_is_work():
    now = [100.0]
    log = StatsLog(10.0, clock=lambda: now[0])
    assert log.line(IDLE) is None  # (the first snapshot starts the interval)
    busy = replace(IDLE, num_running=3, num_waiting=1, num_pages_used=50, num_prompt_tokens=4000,
                   num_generation_tokens=250, prefix_cache_queries=4096, prefix_cache_hits=1024)
    now[0] = 105.0
    assert log.line(busy) is None  # (not yet 10 s)
    now[0] = 110.0
    assert log.line(busy) == ("prompt 400.0 tokens/s, generation 25.0 tokens/s, running 3, "
                              "waiting 1, KV cache 25.0 % in use, prefix cache hit rate 25.0 %")
    now[0] = 120.0  # work still there, no tokens in this interval, no admissions
    assert log.line(busy).endswith("running 3, waiting 1, KV cache 25.0 % in use, prefix "
                                   "cache hit rate - (no prompts admitted)")
    done = replace(busy, num_running=0, num_waiting=0, num_pages_used=0)
    now[0] = 130.0
    assert log.line(done) is None  # an idle interval: nothing to say
    now[0] = 141.0
    assert log.line(replace(done, num_generation_tokens=261)).startswith(
        "prompt 0.0 tokens/s, generation 1.0 tokens/s")
