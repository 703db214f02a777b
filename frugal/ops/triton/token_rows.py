"""Which request a new token of a step belongs to, found inside a kernel from the step's query
offsets, so that kernels over a step's tokens (the DSA indexer's scores, sparse MLA) need no
per-token request tensor built by small PyTorch ops before them (a launch each)."""

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
