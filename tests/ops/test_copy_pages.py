"""Copying KV pages between two pools (a hand-off on one host): the Triton kernel and torch_ref
against a plain loop over pages, on fresh random pools and page lists in any order."""

import pytest
import torch

from frugal.ops.torch_ref.pages import copy_pages as reference

try:
    from frugal.ops.triton.pages import copy_pages as triton_copy
except ImportError:  # (no Triton: the torch_ref cases still run)
    triton_copy = pytest.param(None, marks=pytest.mark.skip(reason="no triton"))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pools(chunks, src_pages, dst_pages, words, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (chunks, src_pages, words * dtype.itemsize), generator=g,
                        dtype=torch.uint8).view(dtype).to(DEVICE)
    dst = torch.randint(0, 256, (chunks, dst_pages, words * dtype.itemsize), generator=g,
                        dtype=torch.uint8).view(dtype).to(DEVICE)
    return src, dst


@pytest.mark.parametrize("copy", [reference, triton_copy], ids=["torch_ref", "triton"])
@pytest.mark.parametrize("chunks,words,dtype", [
    (4, 64, torch.bfloat16),  # whole 32-bit words
    (2, 4100, torch.float32),  # more than one block of the kernel, a partial last one
    (3, 37, torch.uint8),  # bytes alone (a chunk of an odd number of bytes)
    (2, 10, torch.float8_e4m3fn)])
@pytest.mark.parametrize("seed", range(2))
def test_pages_land_where_asked_and_nowhere_else(copy, chunks, words, dtype, seed):
    src, dst = pools(chunks, 9, 13, words, dtype, seed)
    g = torch.Generator().manual_seed(100 + seed)
    n = 6
    dst_ids = torch.randperm(13, generator=g)[:n]  # any order, no repeats
    src_ids = torch.randint(0, 9, (n,), generator=g)  # any order, a page may go twice
    want = dst.clone()
    for d, s in zip(dst_ids.tolist(), src_ids.tolist(), strict=True):
        want[:, d] = src[:, s]
    before = src.clone()
    copy(dst, dst_ids.to(DEVICE), src, src_ids.to(DEVICE))
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(src.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("copy", [reference, triton_copy], ids=["torch_ref", "triton"])
def test_no_pages_and_pools_that_differ(copy):
    src, dst = pools(2, 4, 4, 8, torch.float32, 0)
    want = dst.clone()
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    copy(dst, empty, src, empty)
    assert torch.equal(dst, want)
    one = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    for other in (src[:1], src[..., :4], src.view(torch.int32)):
        with pytest.raises(ValueError, match="differ"):
            copy(dst, one, other, one)
    with pytest.raises(ValueError, match=r"\(2,\) pages to write, \(1,\) to read"):
        copy(dst, torch.zeros(2, dtype=torch.int64, device=DEVICE), src, one)


@pytest.mark.parametrize("copy", [reference, triton_copy], ids=["torch_ref", "triton"])
def test_runs_of_consecutive_pages(copy):
    """Pages consecutive on both sides (one strided copy in torch_ref), next to runs broken on
    one side only and single pages."""
    src, dst = pools(3, 12, 12, 16, torch.float32, 5)
    dst_ids = [2, 3, 4, 9, 10, 0, 7, 8]
    src_ids = [5, 6, 7, 0, 2, 11, 3, 4]
    want = dst.clone()
    want[:, dst_ids] = src[:, src_ids]
    copy(dst, torch.tensor(dst_ids, device=DEVICE), src, torch.tensor(src_ids, device=DEVICE))
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))  # (random bits: NaNs)
