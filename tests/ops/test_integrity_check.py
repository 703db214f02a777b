"""The Triton KV-cache integrity check against its torch_ref twin on fresh random tables."""

import pytest
import torch

from frugal.ops.torch_ref.integrity import check_kv_pages as reference

triton_check = pytest.importorskip("frugal.ops.triton.integrity").check_kv_pages
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(seq_lens, new_tokens, page_size, num_pages, num_stale, seed):
    """Tables of random pages whose expected tags match, then num_stale entries made stale
    (anywhere in the table: some beyond a request's live pages, which must not count)."""
    g = torch.Generator().manual_seed(seed)
    tags = torch.randint(1, 2**31 - 1, (num_pages,), generator=g, dtype=torch.int32)
    width = max(-(-n // page_size) for n in seq_lens) + 1
    table = torch.randint(0, num_pages, (len(seq_lens), width), generator=g, dtype=torch.int32)
    expected = tags[table.long()]
    for _ in range(num_stale):
        r = int(torch.randint(len(seq_lens), (1,), generator=g))
        c = int(torch.randint(width, (1,), generator=g))
        expected[r, c] += 1
    cu = torch.tensor([0] + torch.tensor(new_tokens).cumsum(0).tolist(), dtype=torch.int32)
    slots = torch.arange(sum(new_tokens), dtype=torch.int64)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (table, expected, tags, lens, cu, slots)]


def check(case, page_size, into=False):
    """into: both write into given status buffers (as a captured graph does), filled with junk."""
    table, expected, tags, lens, cu, slots = case
    want_lens, want_slots = lens.clone(), slots.clone()
    junk = [torch.full((len(lens), 4), -7, dtype=torch.int32, device=DEVICE) if into else None
            for _ in range(2)]
    want = reference(table, expected, tags, want_lens, cu, want_slots, page_size, status=junk[0])
    got = triton_check(table, expected, tags, lens, cu, slots, page_size, status=junk[1])
    assert torch.equal(got, want)
    if into:
        assert got.data_ptr() == junk[1].data_ptr() and want.data_ptr() == junk[0].data_ptr()
    assert torch.equal(lens, want_lens) and torch.equal(slots, want_slots)
    return want


@pytest.mark.parametrize("seed", range(4))
def test_matches_torch_ref(seed):
    # decode and prefill rows, an empty (padding) row, tables longer than one block of 256
    case = make_case([1, 17, 0, 40, 4100, 3], [1, 5, 0, 40, 1, 3], 4, 3000, 6, seed)
    status = check(case, 4, into=seed % 2 == 1)
    assert status[2].tolist() == [0, 0, 0, 0]


def test_first_stale_entry_is_reported():
    case = make_case([64], [1], 16, 100, 0, 0)
    table, expected, tags = case[:3]
    expected[0, 3] += 7
    expected[0, 1] -= 2
    status = check(case, 16)
    assert status[0].tolist() == [1, int(table[0, 1]), int(expected[0, 1]), int(tags[table[0, 1]])]


@pytest.mark.gpu
def test_real_shape_on_gpu():
    """64 decode requests of 4,096 tokens, page 16: 256 pages each."""
    case = make_case([4096] * 64, [1] * 64, 16, 64 * 256, 3, 7)
    check(case, 16)
