"""The prefix cache alone and under the scheduler, with fake model outputs: hash chains, sharing,
LRU eviction, stale entries, and the bookkeeping invariants after every step."""

import random

import pytest

from frugal.core.kv_cache_manager import KVCacheManager
from frugal.core.page_allocator import IntegrityError, PageAllocator
from frugal.core.prefix_cache import PrefixCache
from frugal.core.scheduler import Scheduler
from frugal.request import FinishReason, Request, SamplingParams
from tests import kv_faults as faults

PS = 4


def request(i, tokens, max_tokens=3, salt=None, **params) -> Request:
    return Request(str(i), None, list(tokens), SamplingParams(max_tokens=max_tokens, **params),
                   len(tokens) + max_tokens, cache_salt=salt)


def fake_token(r: Request) -> int:
    """Depends only on the tokens so far, as a model's greedy token does."""
    return hash(tuple(r.prompt_token_ids + r.output_token_ids)) % 97 + 1


def scheduler(num_pages=64, budget=64, max_seqs=8):
    return Scheduler(KVCacheManager(num_pages, PS, True, "test-model"), max_seqs, budget)


def uncached(num_pages, max_seqs, budget):
    return Scheduler(KVCacheManager(num_pages, PS, prefix_caching=False), max_seqs, budget)


def run(s: Scheduler, requests, abort=None, max_steps=2000):
    """Drive the scheduler as the engine does, checking every invariant after each step;
    abort: {request_id: step} aborts. Returns (outputs by id, tokens computed per request)."""
    for r in requests:
        s.add(r)
    computed = {r.request_id: 0 for r in requests}
    for step in range(max_steps):
        if not s.num_unfinished:
            break
        out = s.schedule()
        for r, n in zip(out.requests, out.num_new_tokens):
            r.num_computed_tokens += n
            computed[r.request_id] += n
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(fake_token(r))
                if r.num_tokens >= r.max_total_tokens:
                    s.finish(r, FinishReason.LENGTH)
        for r in requests:
            if abort and abort.get(r.request_id) == step:
                s.finish(r, FinishReason.ABORT)
        s.check_integrity()
    assert not s.num_unfinished
    return {r.request_id: r.output_token_ids for r in requests}, computed


def launch(s: Scheduler):
    """Schedule a step and count its tokens as computed (as the engine does at launch)."""
    out = s.schedule()
    for r, n in zip(out.requests, out.num_new_tokens):
        r.num_computed_tokens += n
    return out


def test_hash_chain_names_the_prefix():
    cache = PrefixCache(PageAllocator(8), PS, "model-a")
    a = request(0, range(1, 13))
    b = request(1, list(range(1, 9)) + [99, 10, 11, 12])
    assert cache.hashes(a, 12) == a.page_hashes and len(a.page_hashes) == 3
    cache.hashes(b, 12)
    assert a.page_hashes[:2] == b.page_hashes[:2] and a.page_hashes[2] != b.page_hashes[2]
    assert cache.hashes(request(2, range(1, 13), salt="s"), 12)[0] != a.page_hashes[0]
    other = PrefixCache(PageAllocator(8), PS, "model-b")  # another KV dtype, scales, weights
    assert other.hashes(request(3, range(1, 13)), 12)[0] != a.page_hashes[0]
    assert len(cache.hashes(request(4, range(1, 12)), 11)) == 2  # full pages only


def test_insert_match_evict_in_lru_order():
    allocator = PageAllocator(6)
    cache = PrefixCache(allocator, PS, "m")
    a = request(0, range(1, 13))
    refs = allocator.allocate(3)
    cache.insert(refs, cache.hashes(a, 12))
    assert cache.num_cached == 3 and cache.num_evictable == 0  # a still holds them
    allocator.free(refs)
    cache.released(refs)
    assert cache.num_evictable == 3 and allocator.num_free == 3
    b = request(1, list(range(1, 9)) + [50, 51, 52, 53])
    shared = cache.match(cache.hashes(b, 12), 3)
    assert shared == refs[:2] and cache.num_evictable == 1  # b holds the first two
    cache.check()
    allocator.check([shared, cache.table()])
    assert cache.evict(5) == 1 and cache.num_cached == 2  # only the page nobody else holds
    allocator.free(shared)
    cache.released(shared)
    assert cache.evict(1) == 1 and list(cache.entries.values()) == [refs[0]]  # tail page first
    cache.check()


def test_shared_prompts_compute_once_and_match_unshared():
    s = scheduler()
    system = list(range(1, 18))  # 4 full pages and one token
    reqs = [request(i, system + [100 + i, 200 + i]) for i in range(4)]
    _, computed = run(s, reqs)
    # the first computes its whole prompt; the others (admitted in the same step) share 4 pages
    assert computed["0"] == 19 + 2 and all(computed[str(i)] == 3 + 2 for i in (1, 2, 3))
    assert s.kv.num_cache_hits == 3 * 16 and s.kv.num_cache_queries == 4 * 19
    ref_s = uncached(64, 8, 64)  # no cache: the same tokens
    fresh = [request(i, system + [100 + i, 200 + i]) for i in range(4)]
    assert run(ref_s, fresh)[0] == run(scheduler(), [request(i, system + [100 + i, 200 + i])
                                                     for i in range(4)])[0]


def test_salts_and_scoring_requests_do_not_share():
    s = scheduler()
    prompt = list(range(1, 18))
    reqs = [request(0, prompt, salt="alice"), request(1, prompt, salt="bob"),
            request(2, prompt, prompt_logprobs=0), request(3, prompt, salt="alice")]
    _, computed = run(s, reqs)
    assert computed["1"] == computed["0"] and computed["2"] == computed["0"]
    assert computed["3"] == computed["0"] - 16


def test_random_workload_invariants_preemption_and_aborts():
    """Shared prefixes, a pool small enough to preempt and evict, aborts: the outputs match a
    scheduler without a cache, and the bookkeeping holds after every step."""
    rng = random.Random(0)
    heads = [[rng.randrange(1, 90) for _ in range(rng.randrange(4, 30))] for _ in range(4)]

    def workload():
        r = random.Random(1)
        return [request(i, heads[r.randrange(4)] + [r.randrange(1, 90)
                                                    for _ in range(r.randrange(1, 9))],
                        max_tokens=r.randrange(1, 12)) for i in range(40)]
    aborts = {str(i): i % 7 for i in range(0, 40, 9)}
    s = scheduler(num_pages=24, budget=32, max_seqs=6)
    got, _ = run(s, workload(), aborts)
    want, _ = run(uncached(24, 6, 32), workload(), aborts)
    assert got == want
    assert s.kv.num_cache_hits > 0 and s.kv.num_free == 24
    s.kv.cache.check()


def test_stale_entry_is_never_read():
    s = scheduler(num_pages=16)
    prompt = list(range(1, 18))
    run(s, [request(0, prompt)])
    victim = next(iter(s.kv.cache.entries.values()))
    faults.stale_cache_entry(s.kv.allocator, victim)  # the cache's reference lost: page free
    intruder = request(1, [7] * 4, max_tokens=1)
    s.add(intruder)
    launch(s)  # hands the page out again, with a new tag
    assert victim.page_id in intruder.page_table.ids
    late = request(2, prompt)
    s.add(late)
    launch(s)
    assert s.kv.cache.num_stale == 1  # detected at the match: the prefix stops before it
    assert victim.page_id not in [ref.page_id for ref in late.page_table
                                  if ref.tag == victim.tag]
    assert late.num_computed_tokens == len(prompt)  # computed, not read from the stale page
    s.check_integrity()


def test_check_finds_a_contradiction():
    s = scheduler()
    run(s, [request(0, range(1, 18))])
    page = next(iter(s.kv.cache.entries.values())).page_id
    s.kv.cache._evictable.pop(page)  # evictable pages forgotten: the pool would shrink for good
    with pytest.raises(IntegrityError, match="evictable"):
        s.check_integrity()
    s.recount()
    s.check_integrity()


def test_untrusted_request_takes_its_unwritten_pages_with_it():
    s = scheduler()
    prompt = list(range(1, 18))
    a, b = request(0, prompt), request(1, prompt)
    s.add(a)
    s.add(b)
    launch(s)  # b shares the pages a is writing in this step
    assert list(b.page_table)[:4] == list(a.page_table)[:4]
    sharers = s.untrusted(a, 0)  # a's step was masked: those pages hold nothing
    assert sharers == [b] and s.kv.cache.num_cached == 0
    s.finish(a, FinishReason.ERROR, trusted=False)
    s.finish(b, FinishReason.ERROR)
    s.check_integrity()
    assert s.kv.num_free == 64


def test_eviction_that_meets_stale_entries_only_waits():
    """Evicting pages handed out again behind the cache frees nothing: the request waits
    instead of the step failing (and the idle recount settles the pool)."""
    s = scheduler(num_pages=5)
    run(s, [request(0, range(1, 18), max_tokens=1)])  # 4 full pages cached, all evictable
    assert s.kv.cache.num_evictable == 4 and s.kv.allocator.num_free == 1
    for ref in s.kv.cache.entries.values():
        s.kv.allocator._tag[ref.page_id] += 1  # each handed out again while cached
    s.add(request(1, range(50, 56), max_tokens=1))  # 2 pages: the free one and one evicted
    out = s.schedule()
    assert out.requests == [] and s.kv.cache.num_stale == 4 and s.kv.cache.num_cached == 0
