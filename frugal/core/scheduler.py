"""Continuous batching with one code path: every step schedules a number of tokens per request.

A request has num_tokens (prompt + output so far), num_pending (sampled by a launched step, not
yet read) and num_computed_tokens (those whose KV is in the cache or is written by a launched
step). A step gives each chosen request min(num_tokens + num_pending - num_computed_tokens, budget
left) tokens, so a prompt prefill, a chunk of one, a single decode token and a recompute after
preemption are all the same thing; a request whose pending token is its last (length limit)
gets none. Running requests go first, oldest first; when pages run out the newest running
request is preempted (its pages freed, its progress reset to 0) and recomputed later.

A request whose prompt's KV comes from another worker (request.kv_from_remote, prefill/decode
disaggregation) is admitted like any other but, instead of computing, gets pages for its prompt
and waits in `loading` until the engine reports the pages filled (loaded): then it runs from
num_computed_tokens = its prompt's length. Pages no request table owns but that must not be
reused yet (a prefill's pages until the decode side has read them, a load's pages while the
transfer may still write them) are `held` under a key until released.

With a prefix cache, a request admitted (first, or again after preemption) starts from the
longest run of its leading full pages the cache holds (num_computed_tokens = their tokens, the
same path as any other), and the full pages a step is to write are offered to the cache when the
step is scheduled: a request admitted later in the same step may share them, since every layer
writes the step's KV before it reads any. Pages the cache alone holds are evicted, least recently
used first, when the free list runs short.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from frugal.core.kv_cache_manager import KVCacheManager
from frugal.core.page_allocator import IntegrityError
from frugal.core.page_table import PageTable
from frugal.request import FinishReason, Request, RequestStatus

logger = logging.getLogger("frugal")


@dataclass
class SchedulerOutput:
    """requests[i] computes num_new_tokens[i] tokens this step, from its num_computed_tokens."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    loads: list[Request] = field(default_factory=list)  # admitted to wait for their KV
    # page -> tag for the pages whose tag changed since the last step (the device's copy of the
    # tags takes them before the step's integrity check; kv.return_tag_updates if never sent)
    tag_updates: dict[int, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """Owns the waiting queue, the running and loading lists; their pages come from kv (the
    scheduler's only KV API).

    Invariants (checked by check_integrity): only running and loading requests, held tables
    and the prefix cache hold pages; between steps a running request holds
    ceil(num_computed_tokens / page_size) pages.
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.page_size = kv.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    def live_tables(self) -> list[PageTable]:
        """The page tables of the requests that own pages (running and loading)."""
        return [r.page_table for r in self.running] + [r.page_table for r in self.loading]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            total = request.num_tokens_with_pending
            if total >= request.max_total_tokens:  # its pending token is its last
                i += 1
                continue
            n = min(total - request.num_computed_tokens, budget)
            while not self.kv.grow(request, request.num_computed_tokens + n):
                victim = self.running.pop()  # newest; never one already scheduled (those are < i)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            self._offer(request, n)
            out.requests.append(request)
            out.num_new_tokens.append(n)
            budget -= n
            i += 1
        # New work only when nothing had to give way this step (else it would be preempted again).
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) + len(self.loading) < self.max_num_seqs):
            request = self.waiting[0]
            matched = self.kv.match(request)
            if request.kv_from_remote:  # its prompt's KV comes from elsewhere
                if not self.kv.grow(request, request.num_prompt_tokens):
                    self.kv.unmatch(request)
                    break
                self.kv.count(request, matched)
                self.waiting.popleft()
                request.status = RequestStatus.LOADING
                self.loading.append(request)
                out.loads.append(request)
                continue
            n = min(request.num_tokens_with_pending - request.num_computed_tokens, budget)
            if not self.kv.grow(request, request.num_computed_tokens + n):
                self.kv.unmatch(request)
                break
            self.kv.count(request, matched)
            self._offer(request, n)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.requests.append(request)
            out.num_new_tokens.append(n)
            budget -= n
        out.tag_updates = self.kv.take_tag_updates()
        return out

    def _offer(self, request: Request, num_new_tokens: int) -> None:
        """Offer the cache the full pages the step computes (a loading request's come from
        elsewhere: they are offered with its first step after loaded)."""
        if not request.kv_from_remote:
            self.kv.offer(request, num_new_tokens)

    def untrusted(self, request: Request, start: int) -> list[Request]:
        """The request failed the integrity check in a step from position `start`: what that
        step (and any launched after it) was to write in its pages is not there. Those pages
        leave the cache; returns the other requests that hold one of them."""
        suspect = set(list(request.page_table)[start // self.page_size:])
        self.kv.forget(suspect)
        return [r for r in self.running + self.loading
                if r is not request and any(ref in suspect for ref in r.page_table)]

    def recount(self) -> int:
        """Recount every page from the live tables after a contradiction (see
        PageAllocator.rebuild); returns how many pages became free."""
        return self.kv.recount(self.live_tables())

    def loaded(self, request: Request, num_computed_tokens: int) -> None:
        """A loading request's pages hold its prompt's KV: it runs from num_computed_tokens
        (the prompt's length, or one less to compute its last token here; a page left with
        nothing computed in it is freed)."""
        self.loading.remove(request)
        request.kv_from_remote = False
        request.num_computed_tokens = num_computed_tokens
        self.kv.shrink(request, num_computed_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def release(self, key: str) -> bool:
        """Free held pages (kv.hold); False if nothing is held under key."""
        table = self.kv.release(key)
        if table is None:
            return False
        try:
            self.kv.free(table)
        except IntegrityError as e:  # a bug: say so, and recount from the live tables
            freed = self.recount()
            logger.error("releasing the pages held for %s: %s (%d pages back in the free list "
                         "after a recount)", key, e, freed)
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.page_table)
        request.page_table = PageTable()
        request.num_computed_tokens = request.num_cached_pages = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: FinishReason, trusted: bool = True,
               hold: tuple[str, float] | None = None) -> str | None:
        """Take the request out of the queues and free its pages at once (hold (key, timeout):
        keep them held instead, see hold). Safe in any state and idempotent: a finished request
        stays as it is.

        trusted False (its pages failed the integrity check), or a free that finds a stale
        entry in its page table: instead of freeing that table, the allocator recounts every
        page from the other live tables (see PageAllocator.rebuild). Returns None when the
        table was freed as it is, else what was wrong with it."""
        if request.finished:
            return None
        for queue in (self.running, self.waiting, self.loading):
            if request in queue:
                queue.remove(request)
        table, request.page_table = request.page_table, PageTable()
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        problem = None if trusted else "its pages failed the integrity check"
        if hold is not None and trusted:
            self.kv.hold(hold[0], table, hold[1])
        elif trusted:
            try:
                self.kv.free(table)
            except IntegrityError as e:
                problem = str(e)
        if problem is not None:
            freed = self.recount()
            problem += f" ({freed} pages back in the free list after a recount)"
        return problem

    def check_integrity(self) -> None:
        """Walk all bookkeeping between steps; raises IntegrityError on the first contradiction."""
        for request in self.waiting:
            if request.page_table or request.status is not RequestStatus.WAITING:
                raise IntegrityError(f"waiting request {request.request_id} holds pages or is "
                                     f"{request.status.value}")
        for request in self.running:
            expected = -(-request.num_computed_tokens // self.page_size)
            if (len(request.page_table) != expected
                    or request.status is not RequestStatus.RUNNING):
                raise IntegrityError(
                    f"running request {request.request_id}: {len(request.page_table)} pages for "
                    f"{request.num_computed_tokens} computed tokens (expected {expected})")
        for request in self.loading:
            expected = -(-request.num_prompt_tokens // self.page_size)
            if (len(request.page_table) != expected
                    or request.status is not RequestStatus.LOADING):
                raise IntegrityError(f"loading request {request.request_id}: "
                                     f"{len(request.page_table)} pages for its "
                                     f"{request.num_prompt_tokens} prompt tokens")
        self.kv.check(self.live_tables())
