"""Prefix caching on the real default model (CPU, fp32): the same greedy tokens, log-probabilities
and echoed prompt log-probabilities as with caching off, over shared prefixes, duplicates,
preemptions and aborts, with the bookkeeping walked after every step; stale entries and shared
pages handed out again are caught, failing no request or only the one that holds the page."""

import pytest

from frugal import LLM, SamplingParams
from frugal.request import Request, join
from tests import kv_faults as faults

SYSTEM = ("You are a careful assistant. Answer in one short sentence, plainly, and never make "
          "up facts you do not know. ")
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "Name a prime number.",
             "What do bees make?", "How many legs has a spider?", "What is 7 times 8?"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
ECHO = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1)


def make(caching: bool, memory: str = "16MiB", device: str = "cpu") -> LLM:
    # 16 MiB is 22 pages of 16 tokens: a dozen requests of ~50 tokens must preempt
    return LLM(dtype="float32", device=device, kv_cache_memory=memory,
               enable_prefix_caching=caching)


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def pair(request):
    return make(True, device=request.param), make(False, device=request.param)


def workload():
    """(request id, prompt, params, abort after N steps or None)."""
    jobs = []
    for i, q in enumerate(QUESTIONS):
        jobs.append((f"q{i}", SYSTEM + q, GREEDY, None))
        jobs.append((f"n{i}", SYSTEM + q, GREEDY, None))  # a second choice of the same prompt
    jobs += [("echo0", SYSTEM + QUESTIONS[0], ECHO, None), ("echo1", SYSTEM + "Hi.", ECHO, None),
             ("abort0", SYSTEM + "Tell me a long story.", GREEDY, 3),
             ("abort1", SYSTEM + QUESTIONS[1], GREEDY, 5)]
    return jobs


def drive(llm: LLM, jobs, late=()) -> dict:
    """Run jobs to the end, walking the bookkeeping after every step; late: jobs added at
    step 8 (after the first ones' pages were cached and some evicted)."""
    engine, joined, step = llm.engine, {}, 0
    for rid, prompt, params, _ in jobs:
        engine.add_request(prompt, params, rid)
    while engine.has_unfinished_requests():
        if step == 8:
            for rid, prompt, params, _ in late:
                engine.add_request(prompt, params, rid)
        for out in engine.step():
            join(joined, out)
        engine.scheduler.check_integrity()
        step += 1
        for rid, _, _, at in jobs:
            if at == step:
                out = engine.abort_request(rid)
                if out is not None:
                    join(joined, out)
    assert engine.scheduler.kv.num_free == engine.runner.pool.num_pages
    return joined


def same(got, want, rid) -> None:
    a, b = got[rid].outputs[0], want[rid].outputs[0]
    assert a.token_ids == b.token_ids, rid
    if b.logprobs:
        assert [x.logprob for x in a.logprobs] == pytest.approx(
            [x.logprob for x in b.logprobs], abs=1e-4), rid
    if want[rid].prompt_logprobs:
        assert [None if e is None else (e.token_id, round(e.logprob, 4))
                for e in got[rid].prompt_logprobs] == [
                    None if e is None else (e.token_id, round(e.logprob, 4))
                    for e in want[rid].prompt_logprobs], rid


def test_same_outputs_as_caching_off(pair):
    cached, plain = pair
    jobs = workload()
    late = [(f"late{i}", SYSTEM + q, GREEDY, None) for i, q in enumerate(QUESTIONS[:3])]
    stats = cached.engine.stats()
    got, want = drive(cached, jobs, late), drive(plain, jobs, late)
    for rid, _, _, abort in jobs + late:
        if abort is None:
            same(got, want, rid)
        else:
            assert got[rid].outputs[0].finish_reason == "abort"
    after = cached.engine.stats()
    assert after.num_preemptions > stats.num_preemptions  # the pool is small enough
    assert plain.engine.stats().prefix_cache_hits == 0
    hits = after.prefix_cache_hits - stats.prefix_cache_hits
    assert hits >= 16 * 2 * len(QUESTIONS)  # SYSTEM's first page, the second choices' prompts
    assert after.num_bookkeeping_errors == stats.num_bookkeeping_errors == 0


def test_scores_from_a_start_reuse_the_context(pair):
    """prompt_logprobs_start: the context's pages come from the cache and the continuation's
    scores are those of a full scoring."""
    cached, plain = pair
    context = cached.engine.tokenize(SYSTEM + "The answer is")
    choices = [cached.engine.tokenize(SYSTEM + "The answer is" + c)[len(context):]
               for c in (" yes", " no", " maybe so")]
    full = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    want = plain.generate([context + c for c in choices], full)
    hits = cached.engine.stats().prefix_cache_hits
    got = cached.generate([context + c for c in choices], SamplingParams(
        max_tokens=1, temperature=0, prompt_logprobs=0, prompt_logprobs_start=len(context)))
    assert cached.engine.stats().prefix_cache_hits - hits >= 2 * (len(context) // 16) * 16
    for g, w in zip(got, want):
        assert g.prompt_logprobs[:len(context)] == [None] * len(context)
        assert [e.logprob for e in g.prompt_logprobs[len(context):]] == pytest.approx(
            [e.logprob for e in w.prompt_logprobs[len(context):]], abs=1e-4)


def test_salts_keep_requests_apart(pair):
    cached, _ = pair
    engine = cached.engine
    prompt = SYSTEM + "Tell me about salt."
    for salt, rid in (("alice", "a"), ("bob", "b")):
        hits = engine.stats().prefix_cache_hits
        engine.add_request(prompt, GREEDY, rid, cache_salt=salt)
        drive(cached, [])
        assert engine.stats().prefix_cache_hits == hits
    hits = engine.stats().prefix_cache_hits
    engine.add_request(prompt, GREEDY, "a2", cache_salt="alice")
    drive(cached, [])
    assert engine.stats().prefix_cache_hits > hits
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request(prompt, GREEDY, "bad", cache_salt="")


def test_stale_entry_is_caught_and_nothing_fails():
    """The cache's own reference to a page lost (the page freed and handed out again while
    mapped): a later request with that prefix does not read it, and computes it instead."""
    llm, plain = make(True, "64MiB"), make(False, "64MiB")
    engine, prompt = llm.engine, SYSTEM + QUESTIONS[2]
    want = drive(plain, [("r", prompt, GREEDY, None)])
    drive(llm, [("first", prompt, GREEDY, None)])
    ids = engine.tokenize(prompt)
    probe = Request("probe", None, ids, GREEDY, len(ids) + 1)
    victim = engine.scheduler.kv.cache.entries[engine.scheduler.kv.cache.hashes(probe, 16)[0]]
    faults.stale_cache_entry(engine.scheduler.kv.allocator, victim)
    errors = engine.stats().num_bookkeeping_errors
    engine.add_request("Completely different words here.", GREEDY, "other")  # takes the page
    engine.add_request(prompt, GREEDY, "r")
    joined = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            join(joined, out)
    same(joined, want, "r")
    assert joined["other"].outputs[0].finish_reason == "length"
    assert engine.stats().num_bookkeeping_errors > errors  # detected, counted and logged
    engine.check_integrity()  # (a recount settles what the lost reference left)
    assert engine.check_integrity()
    assert engine.scheduler.kv.num_free == engine.runner.pool.num_pages


def test_shared_page_handed_out_again_fails_only_its_holder():
    """A page a running request shares with the cache goes back to the free list and to a new
    request: the device check fails the request holding the stale entry, no other."""
    llm, plain = make(True, "64MiB"), make(False, "64MiB")
    first, victim_prompt = SYSTEM + QUESTIONS[0], SYSTEM + QUESTIONS[1]
    bystander = "A recipe for pancakes: first, mix flour, milk and two eggs, then"
    want = drive(plain, [("b", bystander, GREEDY, None)])
    drive(llm, [("first", first, GREEDY, None)])
    engine, joined = llm.engine, {}
    engine.add_request(victim_prompt, GREEDY, "victim")
    engine.add_request(bystander, GREEDY, "b")
    for _ in range(3):
        for out in engine.step():
            join(joined, out)
    victim = engine._requests["victim"]
    assert victim.num_cached_pages and engine.scheduler.kv.allocator.refcount(
        victim.page_table[0].page_id) == 2  # shared with the cache
    faults.reuse_while_held(engine.scheduler.kv.allocator, victim.page_table[0])
    engine.add_request("Completely different words here.", GREEDY, "thief")  # takes the page
    failures = engine.num_integrity_failures
    while engine.has_unfinished_requests():
        for out in engine.step():
            join(joined, out)
    assert joined["victim"].outputs[0].finish_reason == "error"
    assert "integrity check failed" in joined["victim"].outputs[0].error
    assert engine.num_integrity_failures == failures + 1
    assert joined["thief"].outputs[0].finish_reason == "length"
    same(joined, want, "b")
    assert engine.check_integrity() and engine.scheduler.kv.num_free == engine.runner.pool.num_pages


def test_token_totals_count_computed_prompt_tokens_and_generated_ones(pair):
    """The stats' totals the server's log line reads: a prompt's tokens count once computed
    (not those the prefix cache held), each recorded token once."""
    cached, _ = pair
    engine = cached.engine
    prompt = engine.tokenize(SYSTEM + "Count my tokens, please. " * 12)  # (~100 tokens)
    before = engine.stats()
    cached.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    first = engine.stats()
    assert first.num_prompt_tokens - before.num_prompt_tokens == len(prompt) - (
        first.prefix_cache_hits - before.prefix_cache_hits)
    assert first.num_generation_tokens - before.num_generation_tokens == 5
    cached.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    second = engine.stats()
    hits = second.prefix_cache_hits - first.prefix_cache_hits
    assert hits >= (len(prompt) // 16 - 1) * 16 > 0
    assert second.num_prompt_tokens - first.num_prompt_tokens == len(prompt) - hits
    assert second.num_generation_tokens - first.num_generation_tokens == 3
