"""Prefix caching: full pages named by a hash chain, shared by the requests whose tokens they hold.

A page's hash is sha256(parent page's hash, its page_size token ids); the chain starts from
sha256(the engine's key, the request's cache_salt), where the engine's key names what makes the
KV of the same tokens differ (model, weights variant, KV dtype and FP8 scales). Only full pages
are cached, so a shared page is never written again.

The cache is a holder of every page it maps (one allocator reference each), so a mapped page
never goes back to the free list behind its back; a page whose only holder is the cache is
evictable, least recently used first, and the allocator's users evict when the free list runs
short. An entry is (page, tag): it is valid only while the page carries that tag (the page has
not been handed out again); a match checks that, and the device check covers a shared page in
every table that holds it, as it covers private ones.
"""

from __future__ import annotations

import array
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterable

from frugal.core.page_allocator import IntegrityError, PageAllocator, PageRef

logger = logging.getLogger("frugal")


class PrefixCache:
    """hash -> PageRef for full pages, one allocator reference per mapped page.

    Invariants (check): entries and the page -> hash map are inverse; every entry's tag is its
    page's current tag; the evictable pages are exactly the mapped pages the cache alone holds.
    """

    def __init__(self, allocator: PageAllocator, page_size: int, key: str) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.key = key.encode()
        self.entries: dict[bytes, PageRef] = {}
        self._hash_of: dict[int, bytes] = {}  # page -> its entry's hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.num_stale = 0  # entries found pointing at a page handed out again (a bug)

    @property
    def num_cached(self) -> int:
        return len(self.entries)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def hashes(self, request, num_tokens: int) -> list[bytes]:
        """The hashes of a request's full pages up to num_tokens (of its known tokens): its
        page_hashes, extended in place. request: a frugal.request.Request (token_ids,
        cache_salt, page_hashes)."""
        ps, known = self.page_size, request.page_hashes
        parent = known[-1] if known else hashlib.sha256(
            self.key + b"\0" + (request.cache_salt or "").encode()).digest()
        for i in range(len(known), num_tokens // ps):
            parent = hashlib.sha256(parent + array.array(
                "i", request.token_ids(i * ps, (i + 1) * ps)).tobytes()).digest()
            known.append(parent)
        return known

    def match(self, hashes: list[bytes], max_pages: int) -> list[PageRef]:
        """The cached pages of the longest cached prefix of `hashes` (at most max_pages), each
        with a reference taken for the caller (free them like any allocated page)."""
        refs = []
        for h in hashes[:max_pages]:
            ref = self.entries.get(h)
            if ref is None:
                break
            if not self._live(ref):  # freed or handed out again behind the cache: never read
                self._drop(h)
                break
            refs.append(self.allocator.share(ref))
            self._evictable.pop(ref.page_id, None)
        return refs

    def insert(self, refs: Iterable[PageRef], hashes: list[bytes]) -> None:
        """Map hashes[i] to refs[i] (full pages whose KV is written, or being written by a
        launched step). A hash already mapped keeps its page; the new page stays private."""
        for ref, h in zip(refs, hashes):
            if h not in self.entries and ref.page_id not in self._hash_of:
                self.entries[h] = self.allocator.share(ref)
                self._hash_of[ref.page_id] = h

    def released(self, refs: Iterable[PageRef]) -> None:
        """A holder dropped these pages (a page table, in position order): those the cache
        alone holds now become evictable, a table's first pages last (they are the most
        shared)."""
        for ref in reversed(list(refs)):
            h = self._hash_of.get(ref.page_id)
            if (h is not None and self.entries[h].tag == ref.tag
                    and self.allocator.refcount(ref.page_id) == 1):
                self._evictable[ref.page_id] = None
                self._evictable.move_to_end(ref.page_id)

    def evict(self, n: int) -> int:
        """Free up to n evictable pages, least recently used first; returns how many."""
        freed = 0
        while freed < n and self._evictable:
            page, _ = self._evictable.popitem(last=False)
            freed += self._drop(self._hash_of[page])
        return freed

    def forget(self, refs: Iterable[PageRef]) -> None:
        """Drop the entries of these pages (their KV is not what their hash says: the step that
        was to write it skipped their request)."""
        for ref in refs:
            h = self._hash_of.get(ref.page_id)
            if h is not None and self.entries[h] == ref:
                self._drop(h)

    def clear(self) -> None:
        """Drop every entry (after a step failed: what it was to write is unknown)."""
        for h in list(self.entries):
            self._drop(h)

    def resync(self) -> None:
        """After the allocator recounted its pages from the live tables (this cache's table
        among them): drop the entries whose page was handed out again, and find the evictable
        pages anew."""
        for h, ref in list(self.entries.items()):
            if not self._live(ref):
                self._drop(h)
        self._evictable = OrderedDict((ref.page_id, None) for ref in self.entries.values()
                                      if self.allocator.refcount(ref.page_id) == 1)

    def table(self) -> list[PageRef]:
        """Every mapped page, as a holder (for the allocator's check and recount)."""
        return list(self.entries.values())

    def check(self) -> None:
        """Raises IntegrityError on the first contradiction (see the class invariants)."""
        if len(self._hash_of) != len(self.entries):
            raise IntegrityError(f"prefix cache: {len(self.entries)} entries but "
                                 f"{len(self._hash_of)} pages mapped")
        for h, ref in self.entries.items():
            if self._hash_of.get(ref.page_id) != h:
                raise IntegrityError(f"prefix cache: page {ref.page_id} mapped twice")
            if self.allocator.tag(ref.page_id) != ref.tag:
                raise IntegrityError(f"prefix cache: page {ref.page_id} expected tag {ref.tag}, "
                                     f"has tag {self.allocator.tag(ref.page_id)}")
            alone = self.allocator.refcount(ref.page_id) == 1
            if alone != (ref.page_id in self._evictable):
                raise IntegrityError(f"prefix cache: page {ref.page_id} has "
                                     f"{self.allocator.refcount(ref.page_id)} holders but is "
                                     f"{'' if alone else 'not '}evictable")
        stray = next((p for p in self._evictable if p not in self._hash_of), None)
        if stray is not None:
            raise IntegrityError(f"prefix cache: page {stray} is evictable but not cached")

    def _live(self, ref: PageRef) -> bool:
        return self.allocator.tag(ref.page_id) == ref.tag and self.allocator.refcount(
            ref.page_id) > 0

    def _drop(self, h: bytes) -> bool:
        """Remove an entry and free the cache's reference; an entry whose page was freed or
        handed out again behind the cache (a bug) is counted and logged instead. Returns
        whether a page was freed."""
        ref = self.entries.pop(h)
        del self._hash_of[ref.page_id]
        self._evictable.pop(ref.page_id, None)
        if self._live(ref):
            self.allocator.free([ref])
            return True
        self.num_stale += 1
        logger.error("prefix cache: page %d, cached with tag %d, has tag %d and %d holders "
                     "(freed or handed out again while cached); entry dropped", ref.page_id,
                     ref.tag, self.allocator.tag(ref.page_id), self.allocator.refcount(ref.page_id))
        return False
