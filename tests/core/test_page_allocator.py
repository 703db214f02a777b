import random

import pytest

from frugal.core.page_allocator import IntegrityError, PageAllocator, PageRef


def test_allocate_free_restores_free_list():
    a = PageAllocator(8)
    refs = a.allocate(5)
    assert a.num_free == 3 and a.num_used == 5
    assert len({r.page_id for r in refs}) == 5
    a.check([refs])
    a.free(refs)
    assert a.num_free == 8
    a.check([])


def test_tag_changes_on_every_reallocation():
    a = PageAllocator(1)
    seen = []
    for _ in range(20):
        (ref,) = a.allocate(1)
        seen.append(ref.tag)
        assert a.tag(ref.page_id) == ref.tag
        a.free([ref])
    assert len(set(seen)) == 20


def test_tags_unique_across_pages():
    a = PageAllocator(4)
    refs = a.allocate(4)
    assert len({r.tag for r in refs}) == 4


def test_out_of_pages_raises():
    a = PageAllocator(2)
    a.allocate(2)
    with pytest.raises(RuntimeError, match="2 pages|free"):
        a.allocate(1)


def test_stale_free_is_caught():
    a = PageAllocator(1)
    (ref,) = a.allocate(1)
    a.free([ref])
    (again,) = a.allocate(1)
    assert again.page_id == ref.page_id and again.tag != ref.tag
    with pytest.raises(IntegrityError):
        a.free([ref])  # the old lifetime's tag
    a.free([again])
    with pytest.raises(IntegrityError):
        a.free([again])  # double free


def test_share_keeps_tag_and_needs_every_holder_to_free():
    a = PageAllocator(2)
    (ref,) = a.allocate(1)
    shared = a.share(ref)
    assert shared.tag == ref.tag
    a.check([[ref], [shared]])
    a.free([ref])
    assert a.num_free == 1
    a.check([[shared]])
    a.free([shared])
    assert a.num_free == 2


def test_check_catches_page_in_two_tables():
    a = PageAllocator(4)
    refs = a.allocate(2)
    with pytest.raises(IntegrityError, match="refcount"):
        a.check([refs, [refs[0]]])


def test_check_catches_stale_tag_and_leak_and_free_page_in_table():
    a = PageAllocator(4)
    refs = a.allocate(2)
    with pytest.raises(IntegrityError, match="tag"):
        a.check([[PageRef(refs[0].page_id, refs[0].tag + 100), refs[1]]])
    with pytest.raises(IntegrityError, match="refcount"):
        a.check([[refs[0]]])  # refs[1] is used but nobody holds it: a leak
    free_page = next(p for p in range(4) if p not in {r.page_id for r in refs})
    with pytest.raises(IntegrityError, match="free"):
        a.check([refs + [PageRef(free_page, 0)]])
    with pytest.raises(IntegrityError, match="twice"):
        a.check([[refs[0], refs[0]], [refs[1]]])


def test_random_workload_keeps_invariants():
    rng = random.Random(0)
    a = PageAllocator(32)
    tables: list[list[PageRef]] = []
    last_tag: dict[int, int] = {}
    for _ in range(2000):
        op = rng.random()
        if op < 0.5 and a.num_free:
            refs = a.allocate(rng.randint(1, a.num_free))
            for r in refs:
                assert r.tag > last_tag.get(r.page_id, 0)
                last_tag[r.page_id] = r.tag
            tables.append(refs)
        elif op < 0.6 and tables:
            src = rng.choice(tables)
            tables.append([a.share(src[0])])
        elif tables:
            a.free(tables.pop(rng.randrange(len(tables))))
        a.check(tables)
        live = [r.page_id for t in tables for r in t]
        assert a.num_used == len(set(live))
    for t in tables:
        a.free(t)
    assert a.num_free == 32
    a.check([])


def test_returned_tag_updates_are_taken_again_newest_tag_winning():
    a = PageAllocator(4)
    first = a.allocate(2)
    taken = a.take_tag_updates()
    assert taken == {r.page_id: r.tag for r in first}
    a.free(first[:1])
    again = a.allocate(3)  # (the freed page comes back last, with a newer tag)
    a.return_tag_updates(taken)
    updates = a.take_tag_updates()
    assert updates == {p: a.tag(p) for p in {r.page_id for r in first + again}}
    assert a.take_tag_updates() == {}
