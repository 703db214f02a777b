"""Overlap scheduling (the next step launched before this one's tokens are read) changes
nothing a user sees: same tokens, texts and finish reasons, no page leaked, aborts still work."""

import pytest

from frugal import LLM, SamplingParams
from frugal.config import CacheConfig, EngineConfig, SchedulerConfig
from frugal.core.page_allocator import IntegrityError
from frugal.request import join


def _engine(overlap: bool):
    config = EngineConfig(dtype="float32", device="cpu", overlap_schedule=overlap,
                          cache=CacheConfig(kv_cache_memory="64MiB"))
    return LLM.from_config(config).engine


def _run(engine, requests, abort_after=None):
    """Drive the engine to the end; abort request `abort_after[0]` once it has abort_after[1]
    outputs. Checks the bookkeeping after every step."""
    ids = [engine.add_request(p, params) for p, params in requests]
    seen, final = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id] = seen.get(out.request_id, 0) + 1
            join(final, out)
            if (abort_after and out.request_id == ids[abort_after[0]] and not out.finished
                    and seen[out.request_id] == abort_after[1]):
                join(final, engine.abort_request(out.request_id))
        engine.scheduler.check_integrity()
    pool = engine.runner.pool
    assert engine.scheduler.kv.num_free == pool.num_pages
    return [(final[i].outputs[0].token_ids, final[i].outputs[0].text,
             final[i].outputs[0].finish_reason, seen[i]) for i in ids]


def test_overlap_changes_no_output():
    requests = [
        ("The capital of France is", SamplingParams(temperature=0, max_tokens=12)),
        ("Once upon a time", SamplingParams(temperature=0.8, seed=7, max_tokens=20,
                                            ignore_eos=True)),
        ("Count: one, two,", SamplingParams(temperature=0, max_tokens=30, stop=["five"])),
        ("A long story:", SamplingParams(temperature=0.7, seed=3, max_tokens=200,
                                         ignore_eos=True)),
        ("Hello", SamplingParams(temperature=0, max_tokens=5, min_tokens=3, logprobs=2)),
    ]
    on, off = _engine(True), _engine(False)
    assert on.overlap and not off.overlap
    ours = _run(on, requests, abort_after=(3, 6))
    assert ours == _run(off, requests, abort_after=(3, 6))
    assert ours[3][2] == "abort" and ours[3][3] == 6
    assert ours[1][3] == 20  # one output per token, none lost when the batch shrinks


def test_overlap_launches_ahead_in_steady_decode():
    engine = _engine(True)
    engine.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=8,
                                                         ignore_eos=True))
    engine.step()  # prefill
    engine.step()  # a decode step, with the next one launched behind it
    assert engine._inflight is not None
    engine.scheduler.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine._inflight is None


def test_a_page_more_than_the_computed_tokens_need_is_caught():
    config = EngineConfig(dtype="float32", device="cpu", overlap_schedule=False,
                          cache=CacheConfig(page_size=4, kv_cache_memory="64MiB"))
    engine = LLM.from_config(config).engine
    engine.add_request([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=8))
    engine.step()  # 4 computed tokens: one full page
    scheduler = engine.scheduler
    scheduler.check_integrity()
    request = scheduler.running[0]  # the page of the next token but one
    assert scheduler.kv.grow(request, request.num_computed_tokens + 2)
    with pytest.raises(IntegrityError):
        scheduler.check_integrity()


def test_overlap_goes_on_through_prompt_chunks():
    """Steps with prompt chunks (alone or beside decodes) are launched ahead too: once the first
    step is queued, the device never waits for the host to read a step before the next is
    queued, and the tokens are those of the engine without overlap."""
    def engine(overlap: bool):
        config = EngineConfig(dtype="float32", device="cpu", overlap_schedule=overlap,
                              cache=CacheConfig(page_size=4, kv_cache_memory="64MiB"),
                              scheduler=SchedulerConfig(max_num_batched_tokens=8))
        return LLM.from_config(config).engine

    prompts = [list(range(1, 20)), list(range(30, 41)), [5, 6, 7]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 9, 4)]
    params.append(SamplingParams(temperature=0.9, seed=11, max_tokens=7, ignore_eos=True,
                                 min_tokens=5))
    prompts.append(list(range(50, 63)))
    results = []
    for overlap in (True, False):
        e = engine(overlap)
        ids = [e.add_request(p, sp) for p, sp in zip(prompts, params)]
        tokens, unfollowed, mixed = {}, 0, 0
        while e.has_unfinished_requests():
            for out in e.step():
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            e.scheduler.check_integrity()
            unfollowed += e.has_unfinished_requests() and e._inflight is None
            inflight = e._inflight
            mixed += inflight is not None and 1 < max(inflight.out.num_new_tokens)
        assert e.scheduler.kv.num_free == e.runner.pool.num_pages
        results.append([tokens[i] for i in ids])
        if overlap:
            assert unfollowed == 0 and mixed > 0
    assert results[0] == results[1]
    assert [len(t) for t in results[0]] == [6, 9, 4, 7]


def test_overlap_goes_on_when_the_batch_shrinks():
    """A request that reaches its length limit is left out of the step launched ahead; the
    others' steps stay overlapped."""
    engine = _engine(True)
    engine.add_request("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=12,
                                                          ignore_eos=True))
    unfollowed = 0  # steps after which requests remain but nothing was launched ahead
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_integrity()
        unfollowed += engine.has_unfinished_requests() and engine._inflight is None
    assert unfollowed == 0
    assert engine.scheduler.kv.num_free == engine.runner.pool.num_pages
