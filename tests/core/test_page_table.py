"""PageTable: page ids and tags side by side, read and written as PageRefs."""

from frugal.core.page_allocator import PageAllocator, PageRef
from frugal.core.page_table import PageTable


def test_entries_round_trip_and_rows_are_int32_arrays():
    allocator = PageAllocator(8)
    table = PageTable(allocator.allocate(3))
    table.extend(allocator.allocate(2))
    assert len(table) == 5 and list(table) == [table[i] for i in range(5)]
    assert table.ids.tolist() == [r.page_id for r in table] == [0, 1, 2, 3, 4]
    assert table.tags.tolist() == [1, 2, 3, 4, 5] and table.ids.itemsize == 4
    table[1] = PageRef(7, 9)
    assert table[1] == PageRef(7, 9) and table.ids[1] == 7 and table.tags[1] == 9
    assert table == [PageRef(0, 1), PageRef(7, 9), PageRef(2, 3), PageRef(3, 4), PageRef(4, 5)]
    assert not PageTable() and table
