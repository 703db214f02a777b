"""The engine thread: outputs reach asyncio callers; one request's failure errors that request
alone and the loop goes on; a dead device or a hung step answers every caller at once."""

import asyncio
import threading
import time

import pytest

from frugal import SamplingParams
from frugal.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from frugal.metrics import Metrics
from tests import kv_faults as faults

LONG = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
SHORT = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)


@pytest.fixture
def engine(llm, monkeypatch):
    """An AsyncEngine over the shared engine; the test may monkeypatch llm.engine. Afterwards
    the shared engine must be idle and whole."""
    e = AsyncEngine(llm.engine, Metrics("m"))
    e.start()
    yield e
    e.shutdown()
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    llm.engine.scheduler.check_integrity()
    assert llm.engine.scheduler.kv.num_free == llm.engine.scheduler.kv.allocator.num_pages


async def collect(engine: AsyncEngine, prompt, params, request_id):
    """(number of outputs, joined token ids, finish reason)"""
    count, tokens, reason = 0, [], None
    async for out in engine.generate(prompt, params, request_id):
        count += 1
        tokens += out.outputs[0].token_ids
        reason = out.outputs[0].finish_reason
    return count, tokens, reason


def run(coro, timeout=120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_generate_then_shutdown(llm):
    engine = AsyncEngine(llm.engine)
    engine.start()
    _, tokens, reason = run(collect(engine, [1, 2, 3], SamplingParams(max_tokens=4,
                                                                      ignore_eos=True), "a"))
    assert len(tokens) == 4 and reason == "length"
    engine.shutdown()
    assert not engine.alive

    async def after():
        with pytest.raises(EngineDeadError):
            await collect(engine, [1, 2], SamplingParams(max_tokens=2), "b")

    run(after(), timeout=10)
    assert not llm.engine.has_unfinished_requests()


def test_rejected_add_is_raised_to_the_caller(engine):
    with pytest.raises(ValueError, match="stop_token_ids"):
        run(collect(engine, [1, 2], SamplingParams(stop_token_ids=[10**7]), "c"), timeout=10)


def test_an_abort_that_raises_leaves_the_others_answered(engine, llm, monkeypatch):
    def broken_abort(request_id):
        raise RuntimeError("abort is broken")

    monkeypatch.setattr(llm.engine, "abort_request", broken_abort)

    async def walk_away():
        async for _ in engine.generate([1, 2, 3], LONG, "gone"):
            break  # closing the iterator aborts: the abort raises on the engine thread

    async def main():
        return await asyncio.gather(walk_away(), *(collect(engine, [5, 6, 7 + i], SHORT, str(i))
                                                   for i in range(3)))

    _, *answered = run(main())
    assert [len(tokens) for _, tokens, _ in answered] == [6, 6, 6]
    assert engine.alive
    monkeypatch.undo()  # the request that could not be aborted runs to its end meanwhile
    assert run(collect(engine, [4, 4], SHORT, "after"))[1]


def test_an_integrity_error_during_abort_is_contained(engine, llm):
    """kv-integrity off and a page handed out while still held: freeing the victim's table on
    abort finds the stale entry. The pages are recounted; nothing raises; the others finish."""
    llm.engine.set_integrity(False)
    try:
        scheduler = llm.engine.scheduler
        started = threading.Event()
        inner = llm.engine.step

        def step():
            victim = llm.engine._requests.get("victim")
            if victim is not None and victim.page_table and not started.is_set():
                faults.reuse_while_held(scheduler.kv.allocator, victim.page_table[0])
                started.set()
            return inner()

        llm.engine.step = step

        async def victim():
            async for _ in engine.generate(list(range(1, 40)), LONG, "victim"):
                if started.is_set():
                    break

        async def main():
            return await asyncio.gather(victim(), *(collect(engine, [9, 8, 7 + i], SHORT,
                                                            f"o{i}") for i in range(3)))

        _, *answered = run(main())
        assert [len(tokens) for _, tokens, _ in answered] == [6, 6, 6]
        assert started.is_set() and engine.alive
        deadline = time.time() + 10
        while llm.engine.num_bookkeeping_errors == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert llm.engine.num_bookkeeping_errors >= 1  # seen and logged, not raised
    finally:
        del llm.engine.step
        llm.engine.set_integrity(True)


def test_an_add_that_raises_errors_that_request_only(engine, llm, monkeypatch):
    inner = llm.engine.add_request

    def add(prompt, params, request_id, *rest):
        if request_id == "bad":
            raise TypeError("unexpected")
        return inner(prompt, params, request_id, *rest)

    monkeypatch.setattr(llm.engine, "add_request", add)

    async def main():
        return await asyncio.gather(collect(engine, [1, 2], SHORT, "bad"),
                                    collect(engine, [1, 2], SHORT, "good"),
                                    return_exceptions=True)

    bad, good = run(main())
    assert isinstance(bad, RequestFailedError) and "unexpected" in str(bad)
    assert len(good[1]) == 6 and engine.alive


def test_a_step_that_raises_errors_the_batch_and_the_loop_goes_on(engine, llm, monkeypatch):
    inner, calls = llm.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("kernel bug")
        return inner()

    monkeypatch.setattr(llm.engine, "step", step)

    async def main():
        return await asyncio.gather(*(collect(engine, [3, 4, i], LONG, f"s{i}")
                                      for i in range(2)), return_exceptions=True)

    results = run(main())
    assert all(isinstance(r, RequestFailedError) and "kernel bug" in str(r) for r in results)
    assert engine.alive and not llm.engine.has_unfinished_requests()
    assert len(run(collect(engine, [3, 4], SHORT, "next"))[1]) == 6


def test_a_step_that_never_returns_marks_the_engine_dead(llm, monkeypatch):
    release = threading.Event()
    inner = llm.engine.step

    def step():
        release.wait(30)
        return inner()

    monkeypatch.setattr(llm.engine, "step", step)
    reasons = []
    engine = AsyncEngine(llm.engine, step_timeout=0.5, on_dead=reasons.append)
    engine.start()

    async def main():
        start = time.monotonic()
        results = await asyncio.gather(*(collect(engine, [1, 2, i], SHORT, f"h{i}")
                                         for i in range(3)), return_exceptions=True)
        return results, time.monotonic() - start

    try:
        results, waited = run(main(), timeout=20)
        assert all(isinstance(r, EngineDeadError) for r in results) and waited < 5
        deadline = time.monotonic() + 5  # on_dead is called just after the callers are answered
        while not reasons and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.alive and "has not returned" in engine.dead and reasons
    finally:
        release.set()
        engine._thread.join(30)
        monkeypatch.undo()
        llm.engine.fail_all("test over")  # what the dead engine still held


def test_a_device_that_fails_its_probe_marks_the_engine_dead(llm, monkeypatch):
    def step():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(llm.engine, "step", step)
    monkeypatch.setattr(llm.engine.runner, "device_ok", lambda: False)
    engine = AsyncEngine(llm.engine)
    engine.start()
    try:
        with pytest.raises(EngineDeadError, match="illegal memory access"):
            run(collect(engine, [1, 2], SHORT, "d"), timeout=20)
        assert not engine.alive and engine.dead
    finally:
        engine.shutdown()
        monkeypatch.undo()
        llm.engine.fail_all("test over")


def test_a_reader_that_stalls_holds_one_joined_output(engine, llm):
    """The engine produces every token while the reader sleeps; what waits is one output."""
    async def main():
        stream = engine.generate([1, 2, 3], LONG, "slow")
        first = await stream.__anext__()
        while llm.engine.has_unfinished_requests():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        rest = [out async for out in stream]
        return first, rest

    first, rest = run(main())
    assert len(rest) == 1 and rest[0].finished
    assert len(first.outputs[0].token_ids) + len(rest[0].outputs[0].token_ids) == 64


def test_the_idle_engine_walks_its_bookkeeping_and_repairs_it(engine, llm):
    metrics = engine.metrics
    run(collect(engine, [1, 2], SHORT, "x"))
    deadline = time.time() + 10
    while metrics.bookkeeping_checks._value.get() < 1 and time.time() < deadline:
        time.sleep(0.05)
    assert metrics.bookkeeping_checks._value.get() >= 1
    allocator = llm.engine.scheduler.kv.allocator
    faults.double_free(allocator, allocator._free[0])  # a bug, found by the next walk
    run(collect(engine, [1, 2], SHORT, "y"))
    deadline = time.time() + 10
    while metrics.bookkeeping_errors._value.get() < 1 and time.time() < deadline:
        time.sleep(0.05)
    assert metrics.bookkeeping_errors._value.get() == 1


@pytest.mark.parametrize("how", ["cancel", "close"])
def test_a_caller_that_goes_away_aborts_its_request(engine, llm, how):
    aborted = engine.metrics.aborted._value.get()

    async def main():
        stream = engine.generate([1, 2, 3], LONG, how)
        if how == "close":
            await stream.__anext__()
            await stream.aclose()
            return
        task = asyncio.create_task(stream.__anext__())
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()

    run(main())
    deadline = time.time() + 10
    while llm.engine.has_unfinished_requests() and time.time() < deadline:
        time.sleep(0.02)
    assert not llm.engine.has_unfinished_requests()
    assert engine.metrics.aborted._value.get() == aborted + 1


def test_the_stats_line_is_logged_while_requests_run(llm, caplog):
    """log_stats: the engine thread logs StatsLog's line (here every 50 ms) while it works."""
    engine = AsyncEngine(llm.engine, log_stats=0.05)
    engine.start()
    try:
        with caplog.at_level("INFO", logger="frugal"):
            run(collect(engine, [1, 2, 3], SamplingParams(max_tokens=48, ignore_eos=True), "s"))
            time.sleep(0.3)  # (the interval that ends idle)
    finally:
        engine.shutdown()
    lines = [r.getMessage() for r in caplog.records if "tokens/s" in r.getMessage()]
    assert lines and lines[0].startswith("prompt ")
    assert any(" generation 0.0 " not in line for line in lines)
    assert all("KV cache" in line and "prefix cache hit rate" in line for line in lines)
