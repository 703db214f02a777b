"""Indices found inside a kernel: which request a new token of a step belongs to (from the step's
query offsets, so that kernels over a step's tokens, the DSA indexer's scores and sparse MLA,
need no per-token request tensor built by small PyTorch ops before them, a launch each), and the
cache slot of a context position."""

import triton
import triton.language as tl


@triton.jit
def token_request(cu_ptr, num_requests, t):
    """The request b holding new token t: the last b with cu[b] <= t (cu_ptr: [num_requests + 1]
    int32, non-decreasing; requests of no new tokens are passed over). A token past
    cu[num_requests] (a padded row) gets the last request: callers compare t with
    cu[num_requests]. Binary search: about log2(num_requests) loads."""
    lo = tl.zeros((), tl.int32)
    hi = tl.zeros((), tl.int32) + num_requests - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        below = tl.load(cu_ptr + mid) <= t
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    return lo


@triton.jit
def page_slot(page, pos, PAGE_SIZE: tl.constexpr):
    """The cache slot of position pos on page `page`: page * PAGE_SIZE + pos % PAGE_SIZE
    (PAGE_SIZE a power of two). The in-page offset is taken with &: Triton 3.6's alignment
    analysis carried `pos % PAGE_SIZE`'s divisibility (16, true of the first of each run of 16
    positions only) over to the sum with a loaded page, so rows a stride of 72 bytes apart
    were read with 16-byte loads (a misaligned address on the GPU). With & the slot's
    divisibility is unknown, and a row's alignment is the row stride's."""
    return page * PAGE_SIZE + (pos & (PAGE_SIZE - 1))
