"""The positions of each row's k largest scores without sorting the row (radix select), for the
DSA indexer's top-k over one row per new token of up to max_seq_len scores.

Each fp32 score becomes a 32-bit key that orders as the floats do (-inf and NaN: key 0, never
chosen). Three histogram passes over the row find the k-th largest key, 11, 11 and 10 bits at a
time: pass L counts the keys that match the bits found so far by their next digit, the next
pass (each program on its own) walks that histogram from the top to the digit where the count
reaches the number still needed. A last pass writes the positions of the keys above that
threshold and of as many keys equal to it as are still needed, each program reserving its
places with one atomic add. Positions come in no particular order; a row with fewer than k
finite scores gets all of them and -1 after. The twin is torch.topk (sorted=False) with -1
where the value is -inf (torch_ref.index_topk); among equal scores at the threshold either
may pick any.

Programs: (rows, cdiv(n, BLOCK)); a [rows, 3 · 2048 + 2] int32 work area holds the three
histograms and the two place counters; a row's first program also writes its -1s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from frugal.ops.triton.sizes import cdiv

BINS = 2048
BLOCK = 2048  # scores a program takes
WORK = 3 * BINS + 2


@triton.jit
def _key(x):
    """fp32 -> uint32 that orders as the floats do; 0 for -inf and NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    return tl.where(x > float("-inf"), key, tl.zeros_like(key))


@triton.jit
def _pick(hist_ptr, need):
    """(the digit whose bin holds the need-th largest key counting from the top bin, how many
    are still needed from that bin); digit -1 when the bins hold fewer than need keys."""
    bins = tl.arange(0, 2048)
    h = tl.load(hist_ptr + bins)
    from_top = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # keys in this bin and above
    above = from_top - h
    digit = tl.max(tl.where((above < need) & (from_top >= need), bins, -1), axis=0)
    return digit, need - tl.sum(tl.where(bins == digit, above, 0), axis=0)


@triton.jit
def _threshold(work, k):
    """(the k-th largest key, how many keys equal to it to take, whether the row has fewer than
    k finite scores: then every one is taken)."""
    d0, need = _pick(work, k)
    d1, need = _pick(work + 2048, need)
    d2, need = _pick(work + 4096, need)
    key = (d0.to(tl.uint32) << 21) | (d1.to(tl.uint32) << 10) | d2.to(tl.uint32)
    return key, need, d0 < 0


@triton.jit
def _histogram(scores_ptr, work_ptr, n, k, s_row, s_work, LEVEL: tl.constexpr,
               BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = _key(tl.load(scores_ptr + row * s_row + offs, mask=offs < n, other=float("-inf")))
    work = work_ptr + row * s_work
    live = key != 0
    if LEVEL == 0:
        digit = (key >> 21).to(tl.int32)
    elif LEVEL == 1:
        d0, need = _pick(work, k)
        live = live & (d0 >= 0) & ((key >> 21).to(tl.int32) == d0)
        digit = ((key >> 10) & 2047).to(tl.int32)
    else:
        d0, need = _pick(work, k)
        d1, need = _pick(work + 2048, need)
        live = live & (d0 >= 0) & ((key >> 10).to(tl.int32) == ((d0 << 11) | d1))
        digit = (key & 1023).to(tl.int32)
    counts = tl.histogram(digit, 2048, mask=live)
    tl.atomic_add(work + LEVEL * 2048 + tl.arange(0, 2048), counts, mask=counts > 0)


@triton.jit
def _select(scores_ptr, work_ptr, out_ptr, n, k, s_row, s_work, s_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = _key(tl.load(scores_ptr + row * s_row + offs, mask=offs < n, other=float("-inf")))
    work = work_ptr + row * s_work
    threshold, need, every = _threshold(work, k)
    above = tl.where(every, key != 0, key > threshold)
    at = (key == threshold) & (key != 0) & ~every
    out = out_ptr + row * s_out
    ones = above.to(tl.int32)
    first = tl.atomic_add(work + 3 * 2048, tl.sum(ones, axis=0))
    tl.store(out + first + tl.cumsum(ones, axis=0) - 1, offs, mask=above)
    ones = at.to(tl.int32)
    first = tl.atomic_add(work + 3 * 2048 + 1, tl.sum(ones, axis=0))
    rank = first + tl.cumsum(ones, axis=0) - 1
    tl.store(out + (k - need) + rank, offs, mask=at & (rank < need))
    if tl.program_id(1) == 0:  # the places past the row's finite scores: -1
        finite = tl.sum(tl.load(work + tl.arange(0, 2048)), axis=0)
        places = tl.arange(0, BLOCK)
        for c0 in range(0, k, BLOCK):
            tl.store(out + c0 + places, -1, mask=(c0 + places < k) & (c0 + places >= finite))


def top_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [rows, n] fp32 (-inf: not a candidate), 1 ≤ k ≤ n. Returns [rows, k] int32: the
    positions of each row's k largest finite scores in no order, -1 past a row's finite ones."""
    rows, n = scores.shape
    out = torch.empty(rows, k, dtype=torch.int32, device=scores.device)
    if rows == 0:
        return out
    work = torch.zeros(rows, WORK, dtype=torch.int32, device=scores.device)
    grid = (rows, cdiv(n, BLOCK))
    for level in range(3):
        _histogram[grid](scores, work, n, k, scores.stride(0), work.stride(0), LEVEL=level,
                         BLOCK=BLOCK, num_warps=4)
    _select[grid](scores, work, out, n, k, scores.stride(0), work.stride(0), out.stride(0),
                  BLOCK=BLOCK, num_warps=4)
    return out
