"""The logical KV cache: which pages each request, hold and cache entry owns. Pure Python.

The scheduler's only KV API. It owns the page allocator (free list, refcounts, tags), the
prefix cache (full pages named by a hash chain of their tokens) and the held tables (pages no
request owns that must not be reused yet: a prefill's pages until a decode worker has read
them, a load's pages while a transfer may still write them). The device holds the pages'
bytes and their tags (worker.kv_pool); a step carries the tags that changed since the last one
(take_tag_updates), so the device's copy stays equal to this one's.

Invariants (check): every live page is owned by a request's table, a held table or the
prefix cache, with refcount equal to its owners; free pages are owned by none.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from frugal.core.page_allocator import PageAllocator, PageRef
from frugal.core.page_table import PageTable
from frugal.core.prefix_cache import PrefixCache
from frugal.request import Request


class KVCacheManager:
    """Pages for requests, held tables and the prefix cache (None: caching off).

    num_pages: the pool's pages (the worker sized it); key: what makes the KV of the same tokens
    differ between engines (model, weights, dtypes, FP8 scales: the root of the cache's hashes).
    """

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True,
                 key: str = "") -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.cache = PrefixCache(self.allocator, page_size, key) if prefix_caching else None
        self.held: dict[str, tuple[PageTable, float]] = {}  # key -> (pages, deadline)
        self.num_cache_queries = 0  # tokens of admitted requests looked up in the cache
        self.num_cache_hits = 0  # of those, tokens found there

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free(self) -> int:
        """Pages a request may get now: free ones and those only the prefix cache holds."""
        return self.allocator.num_free + (self.cache.num_evictable if self.cache else 0)

    @property
    def num_held(self) -> int:
        return sum(len(table) for table, _ in self.held.values())

    # -- requests' pages ---------------------------------------------------------------------

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Give the request's table enough pages for num_tokens tokens in all (evicting cache
        entries only it holds, least recently used first); False, changing nothing, when there
        are not enough."""
        missing = -(-num_tokens // self.page_size) - len(request.page_table)
        if missing <= 0:
            return True
        if missing > self.num_free:
            return False
        if missing > self.allocator.num_free:
            self.cache.evict(missing - self.allocator.num_free)
            if missing > self.allocator.num_free:  # a stale entry freed nothing (logged)
                return False
        request.page_table.extend(self.allocator.allocate(missing))
        return True

    def shrink(self, request: Request, num_tokens: int) -> None:
        """Free the request's pages past those num_tokens tokens need."""
        keep = -(-num_tokens // self.page_size)
        refs = list(request.page_table)
        if len(refs) > keep:
            request.page_table = PageTable(refs[:keep])
            self.free(refs[keep:])

    def free(self, refs: Iterable[PageRef]) -> None:
        """Drop one owner of each page (IntegrityError for a stale entry)."""
        refs = list(refs)
        self.allocator.free(refs)
        if self.cache is not None:
            self.cache.released(refs)

    # -- prefix cache -------------------------------------------------------------------------

    def match(self, request: Request) -> int:
        """Start a request with nothing computed from its cached leading pages (its table and
        num_computed_tokens set to them); returns the tokens it looked up (0: no lookup)."""
        if self.cache is None or request.num_computed_tokens or not request.reads_prefix_cache:
            return 0
        max_pages = request.num_cacheable_tokens // self.page_size
        if max_pages:
            hashes = self.cache.hashes(request, max_pages * self.page_size)
            request.page_table = PageTable(self.cache.match(hashes, max_pages))
            request.num_cached_pages = len(request.page_table)
            request.num_computed_tokens = len(request.page_table) * self.page_size
        return request.num_tokens

    def unmatch(self, request: Request) -> None:
        """Undo match for a request that stays waiting."""
        if request.page_table:
            self.free(request.page_table)
            request.page_table = PageTable()
        request.num_computed_tokens = request.num_cached_pages = 0

    def count(self, request: Request, looked_up: int) -> None:
        """Count an admitted request's lookup (match's return) and what it found."""
        if looked_up:
            self.num_cache_queries += looked_up
            self.num_cache_hits += request.num_computed_tokens

    def offer(self, request: Request, num_new_tokens: int) -> None:
        """Offer the cache the full pages whose tokens the step being scheduled computes."""
        if self.cache is None:
            return
        end = min(request.num_computed_tokens + num_new_tokens, request.num_tokens)
        num_pages = end // self.page_size
        if num_pages > request.num_cached_pages:
            hashes = self.cache.hashes(request, end)
            first = request.num_cached_pages
            self.cache.insert([request.page_table[i] for i in range(first, num_pages)],
                              hashes[first:num_pages])
            request.num_cached_pages = num_pages

    def forget(self, refs: Iterable[PageRef]) -> None:
        """Take these pages out of the cache (their contents are not what their hashes say)."""
        if self.cache is not None:
            self.cache.forget(refs)

    def clear_cache(self) -> None:
        if self.cache is not None:
            self.cache.clear()

    # -- held tables --------------------------------------------------------------------------

    def hold(self, key: str, table: PageTable, timeout: float = float("inf")) -> None:
        """Keep pages out of the free list under key until release(key) (or its deadline,
        see expired)."""
        self.held[key] = (table, time.monotonic() + timeout)

    def release(self, key: str) -> PageTable | None:
        """Stop holding the pages under key and return them for the caller to free (None if
        nothing is held under key)."""
        entry = self.held.pop(key, None)
        return None if entry is None else entry[0]

    def expired(self) -> list[str]:
        now = time.monotonic()
        return [key for key, (_, deadline) in self.held.items() if deadline <= now]

    # -- the device's tags and the bookkeeping ------------------------------------------------

    def take_tag_updates(self) -> dict[int, int]:
        """page -> tag for every page whose tag changed since the last call (for the device)."""
        return self.allocator.take_tag_updates()

    def return_tag_updates(self, updates: dict[int, int]) -> None:
        """Updates a step took but never delivered: they go with the next one."""
        self.allocator.return_tag_updates(updates)

    def tags(self) -> list[int]:
        """Every page's current tag (the device's copy is rebuilt from it)."""
        return self.allocator.tags

    def tables(self, live: Iterable[PageTable]) -> list[PageTable]:
        """Every owner's table: the requests' (live), the held ones and the cache's."""
        return ([*live, *(table for table, _ in self.held.values())]
                + ([self.cache.table()] if self.cache is not None else []))

    def recount(self, live: Iterable[PageTable]) -> int:
        """Recount every page from the owners' tables after a contradiction (see
        PageAllocator.rebuild); returns how many pages became free."""
        freed = self.allocator.rebuild(self.tables(live))
        if self.cache is not None:
            self.cache.resync()
        return freed

    def check(self, live: Iterable[PageTable]) -> None:
        """IntegrityError on the first contradiction between the owners and the allocator."""
        self.allocator.check(self.tables(live))
        if self.cache is not None:
            self.cache.check()
