"""INT4 experts at prompt sizes: dequantized once a step, then multiplied as float experts.

The sorted GEMM widens a weight tile in registers for every block of rows that reads it: at a
few slots an expert that is each weight once, at thousands of tokens (hundreds of slots an
expert) it is each weight many times over, and INT4's unpacking (~10 instructions a weight,
benchmarks/moe_sass.py) then costs more than the products. Past DENSE_SLOTS slots an expert on
average, moe._gemm instead has `chunks` write a chunk of experts in the activations' dtype
(one kernel, each weight unpacked once) and multiplies it on the float path (MODE 0, its
tuned tiles), chunk after chunk into one buffer of at most CHUNK_BYTES: as the dense INT4
linears dequantize for prefill (ops.triton.linear). Experts repacked by moe_int4_tiles
dequantize from that layout.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from frugal.ops.triton import moe_int4_tiles
from frugal.ops.triton.moe_int4_tiles import Int4ExpertTiles
from frugal.ops.triton.sizes import cdiv
from frugal.quant.experts import Int4Experts

# average slots an expert from which INT4 experts are dequantized first (an H100, Qwen3-30B-A3B's
# layer: at 128, 2,048 tokens, 1.97 ms against 3.05 in registers; at 64, 1.92 against 1.75)
DENSE_SLOTS = 128
CHUNK_BYTES = 512 << 20  # the dequantized chunk's buffer (a whole layer's experts if they fit)


def takes(w, slots: int) -> bool:
    """Whether fused_moe dequantizes these experts first for a step of this many slots."""
    return isinstance(w, Int4Experts | Int4ExpertTiles) and slots >= DENSE_SLOTS * w.shape[0]


@triton.jit(do_not_specialize=["first", "rows"])
def _dequantize(w_ptr, s_ptr, out_ptr, first, rows, N, K, swe, swn, sse, ssn,
                GROUP: tl.constexpr, BLOCK_R: tl.constexpr, WORDS: tl.constexpr):
    """out[r, k] = (u - 8) · scale for rows r = (e - first) · N + n of the chunk, k = 8 · word
    + j (nibble j of the word, low first: compressed-tensors packing), WORDS words a program.
    The scales load once a group (a [BLOCK_R, groups] tile) where a program's inputs hold whole
    groups or lie within one; else one a weight."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    word0 = tl.program_id(1) * WORDS
    word = word0 + tl.arange(0, WORDS)
    r_ok = r < rows
    ok = r_ok[:, None] & (word < K // 8)[None, :]
    expert = (r // N + first).to(tl.int64)
    n = r % N
    s_row = s_ptr + expert * sse + n * ssn  # [BLOCK_R]
    words = tl.load(w_ptr + (expert * swe + n * swn)[:, None] + word[None, :], mask=ok, other=0)
    j = tl.arange(0, 8)
    u = ((words[:, :, None] >> (j * 4)[None, None, :]) & 0xF) - 8  # [BLOCK_R, WORDS, 8]
    INPUTS: tl.constexpr = WORDS * 8
    if INPUTS % GROUP == 0:  # whole groups: [BLOCK_R, INPUTS / GROUP] scales
        GROUPS: tl.constexpr = INPUTS // GROUP
        group = word0 * 8 // GROUP + tl.arange(0, GROUPS)
        s = tl.load(s_row[:, None] + group[None, :],
                    mask=r_ok[:, None] & (group * GROUP < K)[None, :], other=0.0)
        w = tl.reshape(u.to(tl.float32), (BLOCK_R, GROUPS, GROUP)) * s.to(tl.float32)[:, :, None]
    elif GROUP % INPUTS == 0:  # within one group: a scale a row
        s = tl.load(s_row + word0 * 8 // GROUP, mask=r_ok, other=0.0)
        w = u.to(tl.float32) * s.to(tl.float32)[:, None, None]
    else:
        k = word[:, None] * 8 + j[None, :]  # [WORDS, 8]
        s = tl.load(s_row[:, None, None] + (k // GROUP)[None, :, :], mask=ok[:, :, None],
                    other=0.0)
        w = u.to(tl.float32) * s.to(tl.float32)
    offs_k = word0 * 8 + tl.arange(0, INPUTS)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * K + offs_k[None, :],
             tl.reshape(w, (BLOCK_R, INPUTS)).to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (offs_k < K)[None, :])


def dequantize(w: Int4Experts, first: int, out: torch.Tensor) -> torch.Tensor:
    """Experts first .. first + len(out) - 1 of w into out [count, N, K] (contiguous, any float
    dtype), each as Int4Experts.expert(e).dequantize(out.dtype) computes it; returns out."""
    count, n, k = out.shape
    packed, scales = w.packed, w.scales
    if (n, k) != w.shape[1:] or not 0 <= first <= w.shape[0] - count or not out.is_contiguous():
        raise ValueError(f"moe_dense.dequantize: experts {first}+{count} of {w.shape} into "
                         f"{tuple(out.shape)}")
    if packed.stride(2) != 1 or scales.stride(2) != 1:
        raise ValueError("moe_dense.dequantize: words and scales contiguous along K")
    rows, block_r, words = count * n, 16, 64
    _dequantize[(cdiv(rows, block_r), cdiv(k // 8, words))](
        packed, scales, out, first, rows, n, k, packed.stride(0), packed.stride(1),
        scales.stride(0), scales.stride(1), GROUP=w.group_size, BLOCK_R=block_r, WORDS=words,
        num_warps=4)
    return out


def chunks(w: Int4Experts | Int4ExpertTiles, dtype: torch.dtype
           ) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(first, last, experts first .. last - 1 [count, N, K] in dtype) chunk after chunk over
    all of w's experts, every chunk written into the same buffer (the stream orders each
    chunk's use before the next one's writing) of CHUNK_BYTES at most, or one expert."""
    e, n, k = w.shape
    per = max(1, min(e, CHUNK_BYTES // (n * k * dtype.itemsize)))
    tiles = isinstance(w, Int4ExpertTiles)
    buffer = torch.empty(per, n, k, dtype=dtype, device=(w.words if tiles else w.packed).device)
    for first in range(0, e, per):
        count = min(per, e - first)
        part = buffer[:count]
        yield first, first + count, (moe_int4_tiles.dequantize(w, first, part) if tiles
                                     else dequantize(w, first, part))
