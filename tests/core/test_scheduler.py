"""Scheduler alone, with fake model outputs: chunking, batching, limits and preemption."""

import random

from frugal.core.kv_cache_manager import KVCacheManager
from frugal.core.scheduler import Scheduler
from frugal.request import FinishReason, Request, SamplingParams


def make_scheduler(num_pages: int, max_num_seqs: int, max_num_batched_tokens: int) -> Scheduler:
    """Pages of 4 tokens, no prefix cache."""
    return Scheduler(KVCacheManager(num_pages, 4, prefix_caching=False), max_num_seqs,
                     max_num_batched_tokens)


def make_request(i: int, prompt_len: int, max_tokens: int) -> Request:
    return Request(str(i), None, list(range(1, prompt_len + 1)),
                   SamplingParams(max_tokens=max_tokens), prompt_len + max_tokens)


def fake_token(request: Request) -> int:
    """Deterministic 'model output': depends only on the request and its position."""
    return (int(request.request_id) * 7919 + request.num_tokens * 31) % 1000


def run(scheduler: Scheduler, requests: list[Request], max_steps: int = 10_000):
    """Drive the scheduler as the engine does; return the per-step outputs."""
    for r in requests:
        scheduler.add(r)
    steps = []
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            break
        out = scheduler.schedule()
        assert out.requests, "a step with unfinished requests scheduled nothing"
        assert out.num_tokens <= scheduler.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.max_num_seqs
        steps.append(out)
        for r, n in zip(out.requests, out.num_new_tokens):
            assert n >= 1
            r.num_computed_tokens += n
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(fake_token(r))
                if r.num_tokens >= r.max_total_tokens:
                    scheduler.finish(r, FinishReason.LENGTH)
        scheduler.check_integrity()
    assert not scheduler.num_unfinished
    return steps


def test_chunked_prefill_under_budget():
    s = make_scheduler(64, max_num_seqs=8, max_num_batched_tokens=10)
    r = make_request(0, prompt_len=25, max_tokens=3)
    steps = run(s, [r])
    assert [o.num_new_tokens for o in steps[:3]] == [[10], [10], [5]]
    assert len(r.output_token_ids) == 3
    assert s.kv.allocator.num_free == 64


def test_decode_batched_with_prefill_chunks():
    s = make_scheduler(64, max_num_seqs=8, max_num_batched_tokens=8)
    a, b = make_request(0, 4, 6), make_request(1, 20, 2)
    steps = run(s, [a, b])
    # step 0: a's whole prompt and a chunk of b; then a decodes one token beside b's chunks
    assert steps[0].requests == [a, b] and steps[0].num_new_tokens == [4, 4]
    assert steps[1].requests == [a, b] and steps[1].num_new_tokens == [1, 7]


def test_max_num_seqs_limits_running():
    s = make_scheduler(256, max_num_seqs=3, max_num_batched_tokens=1000)
    reqs = [make_request(i, 5, 4) for i in range(7)]
    steps = run(s, reqs)
    assert max(len(o.requests) for o in steps) == 3
    assert all(len(r.output_token_ids) == 4 for r in reqs)


def test_preemption_recomputes_and_everything_finishes():
    # 12 pages of 4 tokens; each request needs up to 4 pages, so at most 3 fit at once.
    s = make_scheduler(12, max_num_seqs=8, max_num_batched_tokens=64)
    reqs = [make_request(i, 6, 10) for i in range(6)]
    steps = run(s, reqs)
    preempted = [r for o in steps for r in o.preempted]
    assert preempted, "the pool is too small for all; something must have been preempted"
    for r in reqs:
        assert len(r.output_token_ids) == 10
    # the newest running request is the one that gives way
    first = next(o for o in steps if o.preempted)
    assert int(first.preempted[0].request_id) == max(int(r.request_id) for r in first.requests
                                                     + first.preempted)
    assert s.kv.allocator.num_free == 12


def test_outputs_do_not_depend_on_pool_size_or_budget():
    def tokens(num_pages, budget, seqs):
        rng = random.Random(1)
        reqs = [make_request(i, rng.randint(1, 30), rng.randint(1, 12)) for i in range(10)]
        run(make_scheduler(num_pages, seqs, budget), reqs)
        return [r.output_token_ids for r in reqs]

    reference = tokens(1000, 4096, 256)
    assert tokens(11, 7, 3) == reference
    assert tokens(12, 64, 10) == reference


def test_abort_of_waiting_and_running_frees_pages():
    s = make_scheduler(16, max_num_seqs=1, max_num_batched_tokens=64)
    a, b = make_request(0, 10, 5), make_request(1, 10, 5)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert out.requests == [a]
    a.num_computed_tokens += 10
    s.finish(b, FinishReason.ABORT)  # still waiting
    s.finish(a, FinishReason.ABORT)  # running, holds pages
    assert s.kv.allocator.num_free == 16 and not s.num_unfinished
    s.check_integrity()


def test_finish_is_idempotent_in_every_state():
    s = make_scheduler(16, max_num_seqs=8, max_num_batched_tokens=64)
    running, waiting, never_added = make_request(0, 6, 4), make_request(1, 6, 4), \
        make_request(2, 3, 1)
    s.add(running)
    s.schedule()
    s.add(waiting)
    for r in (running, waiting, never_added):
        assert s.finish(r, FinishReason.ABORT) is None
        assert s.finish(r, FinishReason.ABORT) is None  # again: nothing happens
        assert r.finished and r.finish_reason is FinishReason.ABORT and not r.page_table
    assert not s.num_unfinished and s.kv.allocator.num_free == 16
    s.check_integrity()


def test_finish_with_a_stale_page_table_recounts_instead_of_raising():
    from tests import kv_faults as faults

    s = make_scheduler(8, max_num_seqs=8, max_num_batched_tokens=64)
    victim, other = make_request(0, 8, 4), make_request(1, 4, 4)
    s.add(victim)
    s.schedule()
    victim.num_computed_tokens = 8
    faults.reuse_while_held(s.kv.allocator, victim.page_table[0])  # the page is free and held
    s.add(other)
    s.schedule()  # other's prefill gets that page again, with a new tag
    other.num_computed_tokens = 4
    assert other.page_table[0].page_id == victim.page_table[0].page_id
    problem = s.finish(victim, FinishReason.ABORT)
    assert problem is not None and "tag" in problem and "recount" in problem
    assert victim.finished and victim not in s.running
    s.check_integrity()  # other keeps its page; victim's other page is free again
    assert s.kv.allocator.num_free == 7
    assert s.finish(victim, FinishReason.ABORT) is None
    s.finish(other, FinishReason.STOP)
    assert s.kv.allocator.num_free == 8


def test_finish_untrusted_never_frees_the_table():
    s = make_scheduler(8, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make_request(0, 4, 4), make_request(1, 4, 4)
    s.add(a)
    s.add(b)
    s.schedule()
    a.num_computed_tokens = b.num_computed_tokens = 4
    assert s.finish(a, FinishReason.ERROR, trusted=False) is not None
    s.check_integrity()
    assert s.kv.allocator.num_free == 7 and b.page_table
