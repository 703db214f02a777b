"""A request's page table: the physical pages holding its KV, in position order, with the tag
each page had when the request got it.

Kept as two int32 arrays (page ids, tags) rather than a list of pairs, so a step's inputs copy
each request's row in one memcpy however long the request has grown (see
engine.step_inputs.prepare); entries read and written one at a time are PageRefs.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Iterator

from frugal.core.page_allocator import PageRef


class PageTable:
    """Entry i holds positions [i * page_size, (i + 1) * page_size) of its request."""

    __slots__ = ("ids", "tags")

    def __init__(self, refs: Iterable[PageRef] = ()) -> None:
        self.ids = array.array("i")
        self.tags = array.array("i")
        self.extend(refs)

    def extend(self, refs: Iterable[PageRef]) -> None:
        for page_id, tag in refs:
            self.ids.append(page_id)
            self.tags.append(tag)

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[PageRef]:
        return map(PageRef, self.ids, self.tags)

    def __getitem__(self, index: int) -> PageRef:
        return PageRef(self.ids[index], self.tags[index])

    def __setitem__(self, index: int, ref: PageRef) -> None:
        self.ids[index], self.tags[index] = ref

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (PageTable, list)) else NotImplemented

    def __repr__(self) -> str:
        return f"PageTable({list(self)})"
