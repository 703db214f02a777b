"""Fault injection for the KV-cache integrity tests: the bug classes behind silent cross-request
KV corruption in serving engines, done to a live allocator and page table between steps.

Nothing in the engine calls these; tests do, to show that the device-side check (see
ops.check_kv_pages) catches each class and that only the victim request is affected.
"""

from __future__ import annotations

from frugal.core.page_allocator import PageAllocator, PageRef
from frugal.core.page_table import PageTable


def reuse_while_held(allocator: PageAllocator, ref: PageRef) -> None:
    """Abort/reuse race: the page goes back to the free list (at its head, so the next
    allocation hands it out again) while its holder still has it in its page table."""
    allocator._refcount[ref.page_id] = 0
    allocator._free.appendleft(ref.page_id)


def redirect(page_table: PageTable, index: int, target: PageRef) -> None:
    """A page-table entry overwritten to point at another request's page (the entry keeps the
    tag it had: what the request believes it holds)."""
    page_table[index] = PageRef(target.page_id, page_table[index].tag)


def double_free(allocator: PageAllocator, page_id: int) -> None:
    """A free page freed again: it sits in the free list twice (both at its head), so two
    allocations hand it out, and the first one to get it holds a page someone else now has."""
    allocator._free.remove(page_id)
    allocator._free.extendleft([page_id, page_id])


def stale_cache_entry(allocator: PageAllocator, ref: PageRef) -> None:
    """A prefix-cache entry left behind when the cache's own reference to its page was dropped
    (an eviction or abort path that forgot the map): once no request holds the page it goes
    back to the free list (at its head, so the next allocation hands it out again with a new
    tag) while the cache still maps it."""
    allocator._refcount[ref.page_id] -= 1
    if allocator._refcount[ref.page_id] == 0:
        allocator._free.appendleft(ref.page_id)
