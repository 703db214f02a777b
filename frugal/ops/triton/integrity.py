"""The KV-cache integrity check in Triton. Same signature as frugal.ops.torch_ref.integrity."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from frugal.ops.torch_ref.integrity import STATUS_FIELDS


@triton.jit(do_not_specialize=["table_stride"])
def _check_kernel(table_ptr, expected_ptr, tags_ptr, seq_lens_ptr, cu_ptr, slots_ptr, status_ptr,
                  table_stride, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_T: tl.constexpr):
    """One program per request: its live entries in blocks of BLOCK, then the masking."""
    r = tl.program_id(0)
    num_pages = tl.cdiv(tl.load(seq_lens_ptr + r), PAGE_SIZE)
    offs = tl.arange(0, BLOCK)
    first = num_pages  # index of the first stale entry (num_pages: none)
    page = num_pages * 0
    expected = num_pages * 0
    found = num_pages * 0
    for start in range(0, num_pages, BLOCK):
        i = start + offs
        live = i < num_pages
        ids = tl.load(table_ptr + r * table_stride + i, mask=live, other=0)
        want = tl.load(expected_ptr + r * table_stride + i, mask=live, other=0)
        have = tl.load(tags_ptr + ids, mask=live, other=0)
        stale = live & (have != want)
        block_first = tl.min(tl.where(stale, i, num_pages), 0)
        hit = i == block_first
        earlier = block_first < first
        page = tl.where(earlier, tl.sum(tl.where(hit, ids, 0), 0), page)
        expected = tl.where(earlier, tl.sum(tl.where(hit, want, 0), 0), expected)
        found = tl.where(earlier, tl.sum(tl.where(hit, have, 0), 0), found)
        first = tl.minimum(first, block_first)
    failed = first < num_pages
    row = status_ptr + r * 4
    tl.store(row, failed.to(tl.int32))
    tl.store(row + 1, tl.where(failed, page, 0))
    tl.store(row + 2, tl.where(failed, expected, 0))
    tl.store(row + 3, tl.where(failed, found, 0))
    if failed:
        tl.store(seq_lens_ptr + r, 0)
        t0 = tl.load(cu_ptr + r)
        t1 = tl.load(cu_ptr + r + 1)
        for t in range(t0, t1, BLOCK_T):
            tok = t + tl.arange(0, BLOCK_T)
            tl.store(slots_ptr + tok, tl.full([BLOCK_T], -1, tl.int64), mask=tok < t1)


def check_kv_pages(page_table: torch.Tensor, expected_tags: torch.Tensor, tags: torch.Tensor,
                   seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   slot_mapping: torch.Tensor, page_size: int,
                   status: torch.Tensor | None = None) -> torch.Tensor:
    """See torch_ref.integrity.check_kv_pages."""
    num_requests = page_table.shape[0]
    if status is None:
        status = torch.empty(num_requests, STATUS_FIELDS, dtype=torch.int32, device=tags.device)
    assert status.shape == (num_requests, STATUS_FIELDS) and status.is_contiguous()
    if num_requests == 0:
        return status
    assert expected_tags.stride() == page_table.stride() and page_table.stride(1) == 1
    _check_kernel[(num_requests,)](page_table, expected_tags, tags, seq_lens, cu_seqlens_q,
                                   slot_mapping, status, page_table.stride(0),
                                   PAGE_SIZE=page_size, BLOCK=256, BLOCK_T=256, num_warps=4)
    return status
