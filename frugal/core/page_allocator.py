"""Page bookkeeping in pure Python: free list, refcounts and a tag per physical page.

A tag is a page's generation: every time a page is handed out it gets a fresh tag from one global
counter, so a (page_id, tag) pair names one lifetime of one page. A request's page table holds the
pairs it was given; a pair whose tag no longer matches the page's tag is stale (the page was
freed and handed out again), which is what the integrity checks look for: `check` here between
steps, and on the device before every step (ops.check_kv_pages) against a copy of the tags that
the model runner keeps up to date from `take_tag_updates`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import NamedTuple


class PageRef(NamedTuple):
    """One entry of a page table: the physical page and the tag it had when handed out."""

    page_id: int
    tag: int


class OutOfPagesError(RuntimeError):
    """Raised when more pages are asked for than are free (callers check num_free first)."""


class IntegrityError(RuntimeError):
    """The bookkeeping contradicts itself: a bug, never a user error."""


MAX_TAG = 2**31 - 1  # tags are int32 on the device; the counter wraps to 1 after this


class PageAllocator:
    """Hands out pages of one KV pool.

    Invariants: every page is either free (refcount 0, in the free list once) or used
    (refcount >= 1, not in the free list); a page's tag changes exactly when it leaves the free
    list.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages: must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refcount = [0] * num_pages
        self._tag = [0] * num_pages
        self._next_tag = 1
        self._tag_updates: dict[int, int] = {}  # page -> new tag, since take_tag_updates

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def tag(self, page_id: int) -> int:
        return self._tag[page_id]

    def refcount(self, page_id: int) -> int:
        return self._refcount[page_id]

    def allocate(self, n: int) -> list[PageRef]:
        """Take n free pages, each with a fresh tag and refcount 1."""
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        refs = []
        for _ in range(n):
            page = self._free.popleft()
            self._refcount[page] = 1
            self._tag[page] = self._next_tag
            self._tag_updates[page] = self._next_tag
            self._next_tag = self._next_tag % MAX_TAG + 1
            refs.append(PageRef(page, self._tag[page]))
        return refs

    def take_tag_updates(self) -> dict[int, int]:
        """Pages whose tag changed since the last call, with their new tags."""
        updates, self._tag_updates = self._tag_updates, {}
        return updates

    def return_tag_updates(self, updates: dict[int, int]) -> None:
        """Hand back updates taken for a step that never ran, to be taken again (a page's newer
        tag, from a later hand-out, wins)."""
        self._tag_updates = {**updates, **self._tag_updates}

    @property
    def tags(self) -> list[int]:
        return list(self._tag)

    def rebuild(self, page_tables: Iterable[Iterable[PageRef]]) -> int:
        """Recount every page from the live page tables after an integrity failure, whatever
        corrupted the bookkeeping (a page freed twice, a table entry pointing elsewhere, a page
        handed out while still held): a page is used by the live entries that carry its current
        tag, and free when there are none. Tags stay. Returns how many pages became free."""
        before = len(self._free)
        holders = [0] * self.num_pages
        for table in page_tables:
            for ref in table:
                if self._tag[ref.page_id] == ref.tag:
                    holders[ref.page_id] += 1
        self._refcount = holders
        self._free = deque(p for p in range(self.num_pages) if holders[p] == 0)
        return len(self._free) - before

    def share(self, ref: PageRef) -> PageRef:
        """Add a holder to a used page (prefix sharing); the tag stays while it is shared."""
        self._check_live(ref, "share")
        self._refcount[ref.page_id] += 1
        return ref

    def free(self, refs: Iterable[PageRef]) -> None:
        """Drop one holder of each page; a page with no holder left goes back to the free list."""
        for ref in refs:
            self._check_live(ref, "free")
            self._refcount[ref.page_id] -= 1
            if self._refcount[ref.page_id] == 0:
                self._free.append(ref.page_id)

    def _check_live(self, ref: PageRef, what: str) -> None:
        if self._refcount[ref.page_id] == 0 or self._tag[ref.page_id] != ref.tag:
            raise IntegrityError(
                f"{what} of page {ref.page_id} with tag {ref.tag}: page has tag "
                f"{self._tag[ref.page_id]} and refcount {self._refcount[ref.page_id]}")

    def check(self, page_tables: Iterable[Iterable[PageRef]]) -> None:
        """Integrity walk over every live page table; raises IntegrityError on the first fault.

        free + used == total; no page free twice; each live entry's tag is the page's current tag;
        each used page's refcount equals the number of live tables holding it; no table holds a page
        twice.
        """
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError("a page is in the free list twice")
        holders = [0] * self.num_pages
        for table in page_tables:
            seen = set()
            for ref in table:
                if ref.page_id in seen:
                    raise IntegrityError(f"page {ref.page_id} twice in one page table")
                seen.add(ref.page_id)
                if ref.page_id in free:
                    raise IntegrityError(f"page {ref.page_id} is free but in a live page table")
                if self._tag[ref.page_id] != ref.tag:
                    raise IntegrityError(f"page {ref.page_id}: table expects tag {ref.tag}, "
                                         f"page has {self._tag[ref.page_id]}")
                holders[ref.page_id] += 1
        used = 0
        for page in range(self.num_pages):
            if page in free:
                if self._refcount[page]:
                    raise IntegrityError(f"free page {page} has refcount {self._refcount[page]}")
                continue
            used += 1
            if self._refcount[page] != holders[page]:
                raise IntegrityError(f"page {page}: refcount {self._refcount[page]} but "
                                     f"{holders[page]} live tables hold it")
        if used + len(free) != self.num_pages:
            raise IntegrityError(f"free {len(free)} + used {used} != total {self.num_pages}")
