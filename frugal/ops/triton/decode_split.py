"""What the two decode kernels (attention._decode_kernel and fp8_decode's) share: how a
request's context is cut into slices, and the kernel that merges the slices' partial outputs.

A decode kernel split S ways writes, per (request b, query head, split), the slice's normalized
output [D] at row (b · heads + head) · S + split of `partial` and its natural-log LSE (-inf for
a slice that saw no key) at the same index of `lse`."""

from __future__ import annotations

import triton
import triton.language as tl

from frugal.ops.triton.launch import enter


@triton.jit
def split_len(seq_len, num_splits, BLOCK_N: tl.constexpr, min_split):
    """Keys per context slice of a decode request: whole blocks, at least min_split (a
    multiple of BLOCK_N)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, min_split)


@triton.jit(do_not_specialize=["num_splits", "min_split"])
def merge_kernel(partial_ptr, lse_ptr, out_ptr, cu_ptr, seq_lens_ptr, num_splits, min_split,
                 NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                 SPLITS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """out[row of b, head] = the splits' partials weighted by exp(LSE) (program (b, head))."""
    enter(PDL)
    b = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    base = (b * NUM_HEADS + head) * num_splits
    # only the splits that saw keys (as the decode kernel cut the context)
    seq_len = tl.load(seq_lens_ptr + b)
    per_split = split_len(seq_len, num_splits, BLOCK_N, min_split)
    live = s < tl.minimum(tl.cdiv(seq_len, per_split), num_splits)
    lse = tl.load(lse_ptr + base + s, mask=live, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - top), 0.0)
    part = tl.load(partial_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
                   mask=live[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    row = tl.load(cu_ptr + b)
    tl.store(out_ptr + (row * NUM_HEADS + head) * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)
