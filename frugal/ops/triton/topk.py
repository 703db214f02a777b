"""The positions of each row's k largest scores without sorting the row (radix select), for the
DSA indexer's top-k over one row per new token of up to max_seq_len scores.

Each fp32 score becomes a 32-bit key that orders as the floats do (-inf and NaN: key 0, never
chosen). Four histogram passes over the row find the k-th largest key a byte at a time, highest
byte first: pass L counts, by their byte L, the keys whose bytes above it match those found so
far; the next pass (each program on its own) walks that 256-bin histogram from the top to the
byte where the count reaches the number still needed. A last pass writes the positions of the
keys above that threshold and of as many keys equal to it as are still needed, each program
reserving its places with one atomic add. Positions come in no particular order; a row with
fewer than k finite scores gets all of them and -1 after. The twin is torch.topk (sorted=False)
with -1 where the value is -inf (torch_ref.index_topk); among equal scores at the threshold
either may pick any.

Bytes, not wider digits: tl.histogram counts with one warp ballot per bit of the bin and bit
operations per bin a thread owns, so its cost grows with the bins. Three passes of 11-bit digits
(2,048 bins) took 54 µs at one row of 131,072 scores on an H100, four of bytes 22-24 µs
(torch.topk: 53); at 64 such rows 846 against 222-335 µs (torch.topk: 140).

Programs: (rows, cdiv(n, block)), block = 512-2,048 scores by the step's size (fewer, larger
programs for more scores: measured best); a [rows, 4 · 256 + 3] int32 work area holds the four
histograms, the two place counters and the row's dead tail: how many positions at its end hold
no candidate and are not read (0 from work_area: the whole row is read); a row's first program
also writes its -1s, and the programs wholly inside the dead tail return at once. The first
pass may run inside the kernel that makes the scores (count_first_bytes; the DSA indexer's),
which saves a launch and a read of the row, and writes the dead tail: in a CUDA graph sized for
the longest context served, a short context's row then costs its own length, not the graph's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from frugal.ops.triton.sizes import cdiv

LEVELS, BINS = 4, 256  # bytes of a key, bins of a byte
DEAD = tl.constexpr(LEVELS * BINS + 2)  # the work area's column of the row's dead tail
WORK = DEAD.value + 1


def block(scores: int) -> int:
    """Scores a program takes, for a step of `scores` in all."""
    return 512 if scores <= 1 << 17 else 1024 if scores <= 1 << 18 else 2048


@triton.jit
def _key(x):
    """fp32 -> uint32 that orders as the floats do; 0 for -inf and NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    return tl.where(x > float("-inf"), key, tl.zeros_like(key))


@triton.jit
def _pick(hist_ptr, need):
    """(the byte whose bin holds the need-th largest key counting from the top bin, how many
    are still needed from that bin); byte -1 when the bins hold fewer than need keys."""
    bins = tl.arange(0, 256)
    h = tl.load(hist_ptr + bins)
    from_top = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # keys in this bin and above
    above = from_top - h
    digit = tl.max(tl.where((above < need) & (from_top >= need), bins, -1), axis=0)
    return digit, need - tl.sum(tl.where(bins == digit, above, 0), axis=0)


@triton.jit
def _prefix(work, k, DONE: tl.constexpr):
    """(the top DONE bytes of the k-th largest key as one integer, how many keys matching them
    are still needed, whether the row has k finite scores: if not, every one is taken)."""
    d, need = _pick(work, k)
    found = d >= 0
    prefix = tl.maximum(d, 0).to(tl.uint32)
    for level in tl.static_range(1, DONE):
        d, need = _pick(work + level * 256, need)
        prefix = (prefix << 8) | tl.maximum(d, 0).to(tl.uint32)
    return prefix, need, found


@triton.jit
def _count(work, key, live, LEVEL: tl.constexpr):
    """Add the live keys' byte LEVEL (0: the highest) into the row's histogram LEVEL."""
    digit = ((key >> (24 - 8 * LEVEL)) & 255).to(tl.int32)
    counts = tl.histogram(digit, 256, mask=live)
    tl.atomic_add(work + LEVEL * 256 + tl.arange(0, 256), counts, mask=counts > 0)


@triton.jit
def count_first_bytes(scores, work):
    """The first pass inside the kernel that makes a row's scores (ops.triton.dsa): a block of
    them (fp32, -inf: none) counted into the row's work area (work: its first element)."""
    key = _key(scores)
    _count(work, key, key != 0, 0)


@triton.jit(do_not_specialize=["n"])  # (n, the step's longest context: one variant)
def _histogram(scores_ptr, work_ptr, n, k, s_row, s_work, LEVEL: tl.constexpr,
               BLOCK: tl.constexpr):
    row = tl.program_id(0)
    work = work_ptr + row * s_work
    n = n - tl.load(work + DEAD)
    if tl.program_id(1) * BLOCK >= n:
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = _key(tl.load(scores_ptr + row * s_row + offs, mask=offs < n, other=float("-inf")))
    live = key != 0
    if LEVEL > 0:
        prefix, need, found = _prefix(work, k, LEVEL)
        live = live & found & ((key >> (32 - 8 * LEVEL)) == prefix)
    _count(work, key, live, LEVEL)


@triton.jit(do_not_specialize=["n"])
def _select(scores_ptr, work_ptr, out_ptr, n, k, s_row, s_work, s_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    work = work_ptr + row * s_work
    n = n - tl.load(work + DEAD)
    if tl.program_id(1) > 0 and tl.program_id(1) * BLOCK >= n:
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = _key(tl.load(scores_ptr + row * s_row + offs, mask=offs < n, other=float("-inf")))
    threshold, need, found = _prefix(work, k, 4)
    above = tl.where(found, key > threshold, key != 0)
    at = (key == threshold) & (key != 0) & found
    out = out_ptr + row * s_out
    ones = above.to(tl.int32)
    first = tl.atomic_add(work + 4 * 256, tl.sum(ones, axis=0))
    tl.store(out + first + tl.cumsum(ones, axis=0) - 1, offs, mask=above)
    ones = at.to(tl.int32)
    first = tl.atomic_add(work + 4 * 256 + 1, tl.sum(ones, axis=0))
    rank = first + tl.cumsum(ones, axis=0) - 1
    tl.store(out + (k - need) + rank, offs, mask=at & (rank < need))
    if tl.program_id(1) == 0:  # the places past the row's finite scores: -1
        finite = tl.sum(tl.load(work + tl.arange(0, 256)), axis=0)
        places = tl.arange(0, BLOCK)
        for c0 in range(0, k, BLOCK):
            tl.store(out + c0 + places, -1, mask=(c0 + places < k) & (c0 + places >= finite))


def work_area(rows: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed [rows, WORK] int32 work area: the kernel that makes the scores may count its
    first pass into it (count_first_bytes) and write each row's dead tail (column DEAD) before
    top_positions(..., work=) runs the rest."""
    return torch.zeros(rows, WORK, dtype=torch.int32, device=device)


def top_positions(scores: torch.Tensor, k: int, out: torch.Tensor | None = None,
                  work: torch.Tensor | None = None) -> torch.Tensor:
    """scores [rows, n] fp32 (-inf: not a candidate; NaN neither, where torch.topk takes it
    first), 1 ≤ k ≤ n. Returns [rows, k] int32 (into `out` if given: rows of unit stride): the
    positions of each row's k largest finite scores in no order, -1 past a row's finite ones.
    work: a work_area whose first histogram holds every score of its row already (counted
    where the scores were made), its column DEAD how many scores at the row's end to leave
    unread (they may be garbage; the -1s then start sooner); None: the first pass runs here,
    over whole rows."""
    rows, n = scores.shape
    if not 1 <= k <= n or scores.stride(1) != 1:
        raise ValueError(f"top_positions: k = {k} of rows of {n} scores, stride "
                         f"{scores.stride(1)}")
    if out is None:
        out = torch.empty(rows, k, dtype=torch.int32, device=scores.device)
    elif out.shape != (rows, k) or out.dtype != torch.int32 or out.stride(1) != 1:
        raise ValueError(f"top_positions: out {tuple(out.shape)} {out.dtype}, not "
                         f"({rows}, {k}) int32 rows")
    if work is not None and (work.shape != (rows, WORK) or work.dtype != torch.int32
                             or work.stride(1) != 1):
        raise ValueError(f"top_positions: work {tuple(work.shape)} {work.dtype}, not "
                         f"({rows}, {WORK}) int32 rows")
    if rows == 0:
        return out
    first = 0 if work is None else 1  # (the levels counted already)
    work = work_area(rows, scores.device) if work is None else work
    size = block(rows * n)
    grid = (rows, cdiv(n, size))
    for level in range(first, LEVELS):
        _histogram[grid](scores, work, n, k, scores.stride(0), work.stride(0), LEVEL=level,
                         BLOCK=size, num_warps=4)
    _select[grid](scores, work, out, n, k, scores.stride(0), work.stride(0), out.stride(0),
                  BLOCK=size, num_warps=4)
    return out
