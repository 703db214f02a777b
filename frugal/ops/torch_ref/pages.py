"""Whole KV pages from one pool to another (a KV hand-off between two workers on one host)."""

from __future__ import annotations

import torch


def copy_pages(dst: torch.Tensor, dst_pages: torch.Tensor, src: torch.Tensor,
               src_pages: torch.Tensor) -> None:
    """dst[:, dst_pages[i]] = src[:, src_pages[i]] for every i, in place.

    dst: [chunks, dst_num_pages, words], src: [chunks, src_num_pages, words], one dtype, on one
    device (a page is `chunks` rows of `words`, one a layer and K/V part: KVPool.storage
    viewed so); dst_pages, src_pages: [n] int64 on that device, dst_pages without repeats (a
    page written twice would take either copy). One strided copy a run of pages consecutive on
    both sides (memcpy speed on a CPU, where a gather of bytes is several times slower)."""
    check_pools(dst, dst_pages, src, src_pages)
    run = None  # (dst first, src first, pages)
    for d, s in zip(dst_pages.tolist(), src_pages.tolist(), strict=True):
        if run is not None and d == run[0] + run[2] and s == run[1] + run[2]:
            run = (run[0], run[1], run[2] + 1)
            continue
        if run is not None:
            dst[:, run[0]:run[0] + run[2]].copy_(src[:, run[1]:run[1] + run[2]])
        run = (d, s, 1)
    if run is not None:
        dst[:, run[0]:run[0] + run[2]].copy_(src[:, run[1]:run[1] + run[2]])


def check_pools(dst: torch.Tensor, dst_pages: torch.Tensor, src: torch.Tensor,
                src_pages: torch.Tensor) -> None:
    """ValueError unless dst and src are pools of pages of one shape and dtype on one device,
    and the page lists as long as each other."""
    if dst_pages.shape != src_pages.shape or dst_pages.dim() != 1:
        raise ValueError(f"copy_pages: {tuple(dst_pages.shape)} pages to write, "
                         f"{tuple(src_pages.shape)} to read")
    if (dst.dim() != 3 or src.dim() != 3 or dst.shape[0] != src.shape[0]
            or dst.shape[2] != src.shape[2] or dst.dtype != src.dtype
            or dst.device != src.device):
        raise ValueError(f"copy_pages: pools of pages {tuple(dst.shape)} {dst.dtype} on "
                         f"{dst.device} and {tuple(src.shape)} {src.dtype} on {src.device} "
                         "differ")
