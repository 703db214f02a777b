"""Whole KV pages from one pool to another in one launch. Same signature as
frugal.ops.torch_ref.pages."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from frugal.ops.torch_ref.pages import check_pools

BLOCK = 2048  # words a program moves per iteration


# (the pools' page counts: one variant whatever they are, compiled before serving)
@triton.jit(do_not_specialize=["dst_num_pages", "src_num_pages"])
def _copy_pages_kernel(dst, dst_pages, src, src_pages, dst_num_pages, src_num_pages, words,
                       BLOCK: tl.constexpr):
    """Program (i, c): chunk c of page pair i, `words` elements, BLOCK at a time."""
    i = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    d = tl.load(dst_pages + i)
    s = tl.load(src_pages + i)
    to = dst + (c * dst_num_pages + d) * words
    frm = src + (c * src_num_pages + s) * words
    offs = tl.arange(0, BLOCK)
    for start in range(0, words, BLOCK):
        m = start + offs < words
        tl.store(to + start + offs, tl.load(frm + start + offs, mask=m), mask=m)


def copy_pages(dst: torch.Tensor, dst_pages: torch.Tensor, src: torch.Tensor,
               src_pages: torch.Tensor) -> None:
    """See torch_ref.pages.copy_pages: one program a page and chunk, in 32-bit words where a
    chunk's bytes allow (every production row layout: pages of 16 tokens)."""
    check_pools(dst, dst_pages, src, src_pages)
    n = dst_pages.numel()
    if n == 0:
        return
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("copy_pages: the pools must be contiguous")
    chunk_bytes = dst.shape[2] * dst.element_size()
    word = torch.int32 if chunk_bytes % 4 == 0 else torch.uint8
    d, s = (t.view(torch.uint8).view(word) for t in (dst, src))
    _copy_pages_kernel[(n, d.shape[0])](d, dst_pages, s, src_pages, d.shape[1], s.shape[1],
                                        d.shape[2], BLOCK=BLOCK)
