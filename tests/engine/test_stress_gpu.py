"""Overlap scheduling where it can go wrong: on the GPU, where a launched step runs while the host
schedules the next. A tiny page pool (preemptions), long and short prompts arriving over time,
random aborts, CUDA graphs: greedy tokens with overlap on equal those with it off and those of
each request run alone; the bookkeeping is whole after every step and the pool full at the end.
A device-side fault marks the engine dead instead of hanging its callers."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from frugal import LLM, SamplingParams
from frugal.request import join

pytestmark = pytest.mark.gpu

NUM_REQUESTS = 48


def workload(seed: int = 0) -> list[tuple[list[int], SamplingParams, int | None]]:
    """(prompt, params, abort once this many tokens are out or None) per request."""
    rng = random.Random(seed)
    out = []
    for i in range(NUM_REQUESTS):
        n = rng.randint(150, 400) if i % 3 == 0 else rng.randint(1, 24)
        prompt = [rng.randrange(100, 40000) for _ in range(n)]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 64), ignore_eos=True)
        abort = rng.randint(1, 6) if rng.random() < 0.2 and params.max_tokens > 8 else None
        out.append((prompt, params, abort))
    return out


def drive(llm: LLM, work) -> tuple[dict[str, tuple[list[int], str]], dict[str, int]]:
    """Requests join two every three steps; each with an abort point is aborted once it has
    that many tokens out. Walks the bookkeeping after every step."""
    engine = llm.engine
    joined, pending, ids, steps, ahead = {}, list(enumerate(work)), {}, 0, 0
    abort_at = {}
    while pending or engine.has_unfinished_requests():
        if pending and (steps == 0 or steps % 3 == 0):
            for i, (prompt, params, abort) in pending[:8 if steps == 0 else 2]:
                ids[engine.add_request(prompt, params, request_id=str(i))] = i
                if abort is not None:
                    abort_at[str(i)] = abort
            pending = pending[8 if steps == 0 else 2:]
        for out in engine.step():
            got = join(joined, out)
            rid = out.request_id
            if not got.finished and rid in abort_at and len(got.outputs[0].token_ids) >= \
                    abort_at[rid]:
                join(joined, engine.abort_request(rid))
        engine.scheduler.check_integrity()
        ahead += engine._inflight is not None
        steps += 1
    assert engine.scheduler.kv.num_free == engine.runner.pool.num_pages
    engine.scheduler.check_integrity()
    results = {rid: (o.outputs[0].token_ids, o.outputs[0].finish_reason)
               for rid, o in joined.items()}
    return results, {"steps": steps, "ahead": ahead, "preemptions": engine.num_preemptions}


def test_overlap_under_pressure_changes_no_token():
    work = workload()
    kwargs = dict(dtype="float32", device="cuda", page_size=16, kv_cache_memory="40MiB",
                  max_num_seqs=16, max_num_batched_tokens=512)
    on = LLM(**kwargs)
    assert on.engine.overlap and on.engine.runner.graphs is not None
    got_on, stats_on = drive(on, work)
    del on
    off = LLM(**kwargs)
    off.engine.overlap = False
    got_off, stats_off = drive(off, work)
    del off
    assert stats_on["preemptions"] > 0 and stats_off["preemptions"] > 0, (stats_on, stats_off)
    assert stats_on["ahead"] > stats_on["steps"] // 2  # most steps were launched ahead
    alone = LLM(dtype="float32", device="cuda", kv_cache_memory="1GiB")
    for i, (prompt, params, abort) in enumerate(work):
        rid = str(i)
        want = alone.generate(prompt, params)[0].outputs[0].token_ids
        for got in (got_on, got_off):
            tokens, reason = got[rid]
            if abort is None:
                assert (tokens, reason) == (want, "length"), rid
            else:
                assert reason == "abort" and tokens == want[:len(tokens)], rid


DEVICE_FAULT = """
import asyncio, torch
from frugal import LLM, SamplingParams
from frugal.engine.async_engine import AsyncEngine, EngineDeadError
llm = LLM(dtype="float32", device="cuda", kv_cache_memory="256MiB", enforce_eager=True)
runner, forward = llm.engine.runner, llm.engine.runner.forward
def broken(inputs):
    x = torch.zeros(4, device="cuda")
    x[torch.tensor([1 << 40], device="cuda")] = 1.0  # a device-side assert: sticky
    return forward(inputs)
runner.forward = broken
engine = AsyncEngine(llm.engine)
engine.start()
async def ask():
    async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=4), "x"):
        pass
try:
    asyncio.run(asyncio.wait_for(ask(), 60))
except EngineDeadError as e:
    print("DEAD:", e, "| alive:", engine.alive)
"""


def test_a_device_side_fault_marks_the_engine_dead():
    r = subprocess.run([sys.executable, "-c", DEVICE_FAULT], capture_output=True, text=True,
                       timeout=300)
    assert "DEAD: engine dead: the device failed" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "alive: False" in r.stdout
