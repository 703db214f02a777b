"""INT4 experts' K loop on the sorted path (moe._sorted_gemm, MODE 2, 16 words or more a step).

An expert's matrix is [N, K / 8] int32 words; input k = 8 · word + j is the word's nibble j
(w = (u - 8) · scale, a scale per row and S_BK inputs). A step of BLOCK_K inputs loads the
rows' activations once, [BLOCK_M, BLOCK_K] contiguous, and splits them in registers into the
8 column sets j (a word's 8 inputs lie in one thread's registers: the splits move nothing);
each nibble j then multiplies as its own dot over the step's words, so the unpacked weights
need no reshape. Under few rows the products may be taken transposed, outᵀ = W · aᵀ: the weights'
outputs on the MMA's 64-row side and the dequantized weights its A operand, from registers
(Hopper's wgmma), where mma.sync's 16 rows would hold the few tokens: FRUGAL_INT4_TRANS_BELOW
sets the rows under which products are transposed (default 0, never: on an H200 the transposed
products took 2.7x as long at 16 tokens of Qwen3-30B-A3B). On the GPU the weights dequantize in bf16
pairs (_magic: ~1.5 instructions a weight fewer than the fp32 way; an H100 at Qwen3-30B-A3B's
shapes: 13 % faster at 16 tokens, 6-8 % at 64-256); FRUGAL_INT4_BF16=0 takes the fp32 way.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

ONE_BITS = 0x3F800000  # 1.0 in fp32: `magic` (nibble)
TRANS_BELOW = tl.constexpr(int(os.environ.get("FRUGAL_INT4_TRANS_BELOW", "0")))
BF16_MAGIC = tl.constexpr(os.environ.get("FRUGAL_INT4_BF16", "1") == "1")


@triton.jit
def nibble(words, j: tl.constexpr, magic):
    """The j-th inputs of INT4 words as the fp32 1 + u/16: nibble j rotated to bits 19-22 (the
    top of the mantissa; one funnel shift) and put into 1.0's bits (one LOP3 with `magic`,
    0x3F800000 in a register, so the AND and the OR fuse). (u - 8) · s = f · 16 s - 24 s."""
    u = words.to(tl.uint32, bitcast=True)
    rot: tl.constexpr = (4 * j + 13) % 32
    f = (((u >> rot) | (u << (32 - rot))) & 0x780000) | magic
    return f.to(tl.float32, bitcast=True)


LO = tl.constexpr("prmt.b32 t, $1, $2, 0x5410;")
HI = tl.constexpr("prmt.b32 t, $1, $2, 0x7632;")


@triton.jit
def _magic(x, PICK: tl.constexpr):
    """The nibbles at bits 0-3 (LO) or 16-19 (HI) of int32 x as bf16 u - 8, two at a time: the
    halves of a pair of elements side by side (one PRMT), masked into 128's bits (one LOP3:
    the bf16 128 + u), minus 136 in bf16x2 (exact)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, c; " + PICK.value
        + " lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 c, 0x43084308;"
        " sub.rn.bf16x2 $0, t, c; }",
        "=r,r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def columns(a, BLOCK_M: tl.constexpr, WORDS: tl.constexpr):
    """a [BLOCK_M, 8 · WORDS] -> its inputs 8 · word + j as 8 tensors [BLOCK_M, WORDS], j = 0..7
    (three halvings of j's bits: the lowest first)."""
    a = tl.reshape(a, (BLOCK_M, WORDS, 2, 2, 2))  # (.., j >> 2, (j >> 1) & 1, j & 1)
    even, odd = tl.split(a)
    e0, e1 = tl.split(even)
    o0, o1 = tl.split(odd)
    c0, c4 = tl.split(e0)
    c2, c6 = tl.split(e1)
    c1, c5 = tl.split(o0)
    c3, c7 = tl.split(o1)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _scales(s_base, word, w_ok, offs_n, n_ok, ssn, ssk, S_BK: tl.constexpr,
            TRANS: tl.constexpr):
    """The group scale of each word of `word` for outputs offs_n, as stored (bf16: half the
    registers while held a step), [BLOCK_N, WORDS] if TRANS, else [WORDS, BLOCK_N] (0 where
    masked)."""
    group = word * 8 // S_BK
    if TRANS:
        s = tl.load(s_base + offs_n[:, None] * ssn + group[None, :] * ssk,
                    mask=n_ok[:, None] & w_ok[None, :], other=0.0)
    else:
        s = tl.load(s_base + offs_n[None, :] * ssn + group[:, None] * ssk,
                    mask=w_ok[:, None] & n_ok[None, :], other=0.0)
    return s


@triton.jit
def _step(cols, w_base, s, word, w_ok, offs_n, n_ok, swn, swk, acc, magic,
          F32_DOT: tl.constexpr, TRANS: tl.constexpr):
    """acc + a · w over the inputs of `word` for outputs offs_n (s: their scales, _scales'):
    acc [BLOCK_N, BLOCK_M] if TRANS, else [BLOCK_M, BLOCK_N]. A weight costs a shift, a LOP3,
    an FMA and half a conversion."""
    if TRANS:  # words [BLOCK_N, WORDS]: a row's words contiguous
        words = tl.load(w_base + offs_n[:, None] * swn + word[None, :] * swk,
                        mask=n_ok[:, None] & w_ok[None, :], other=0)
    else:  # [WORDS, BLOCK_N]
        words = tl.load(w_base + offs_n[None, :] * swn + word[:, None] * swk,
                        mask=w_ok[:, None] & n_ok[None, :], other=0)
    # (bf16 pairs only where activations and scales are bf16: fp16 activations multiply fp16
    # weights, other scales keep their precision)
    if BF16_MAGIC and not F32_DOT and cols[0].dtype == tl.bfloat16 and s.dtype == tl.bfloat16:
        sb = s
        for j in tl.static_range(4):
            x = words >> (4 * j)
            lo = _magic(x, LO)
            hi = _magic(x, HI)
            if TRANS:
                acc += tl.dot(lo * sb, tl.trans(cols[j]))
                acc += tl.dot(hi * sb, tl.trans(cols[j + 4]))
            else:
                acc += tl.dot(cols[j], lo * sb)
                acc += tl.dot(cols[j + 4], hi * sb)
        return acc
    s = s.to(tl.float32)
    s16, offset = s * 16.0, s * -24.0
    for j in tl.static_range(8):
        w = nibble(words, j, magic) * s16 + offset
        c = cols[j]
        if F32_DOT:  # (fp32 activations, and the interpreter, whose bf16 dot is wrong)
            if TRANS:
                acc += tl.dot(w, tl.trans(c.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(c.to(tl.float32), w, input_precision="ieee")
        elif TRANS:
            acc += tl.dot(w.to(c.dtype), tl.trans(c))
        else:
            acc += tl.dot(c, w.to(c.dtype))
    return acc


@triton.jit
def int4_gemm(a_rows, row_ok, w_base, s_base, offs_n, n_ok, N, K, swn, swk, ssn, ssk, magic,
              GATED: tl.constexpr, S_BK: tl.constexpr, F32_DOT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(acc, acc_up) [BLOCK_M, BLOCK_N] fp32: the rows a_rows (pointers [BLOCK_M, 1] to their
    activations, K of them) times the expert's outputs offs_n (and offs_n + N, the up half, if
    GATED; else acc_up is zeros). w_base, s_base: the expert's words and scales. BLOCK_K: a
    multiple of 128."""
    WORDS: tl.constexpr = BLOCK_K // 8
    TRANS: tl.constexpr = BLOCK_M < TRANS_BELOW
    if TRANS:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # (the scales are loaded a step ahead: 2-byte loads, which Triton's pipelining of the
    # words and activations through shared memory leaves in the loop, their latency exposed)
    up_w, up_s = w_base + N * swn, s_base + N * ssn  # (the up half: rows N on)
    word = tl.arange(0, WORDS)
    s = _scales(s_base, word, word < K // 8, offs_n, n_ok, ssn, ssk, S_BK, TRANS)
    s_up = s
    if GATED:
        s_up = _scales(up_s, word, word < K // 8, offs_n, n_ok, ssn, ssk, S_BK, TRANS)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
        cols = columns(a, BLOCK_M, WORDS)
        word = k0 // 8 + tl.arange(0, WORDS)
        w_ok = word < K // 8
        after = word + WORDS
        s_next = _scales(s_base, after, after < K // 8, offs_n, n_ok, ssn, ssk, S_BK, TRANS)
        acc = _step(cols, w_base, s, word, w_ok, offs_n, n_ok, swn, swk, acc, magic, F32_DOT,
                    TRANS)
        s = s_next
        if GATED:
            s_next = _scales(up_s, after, after < K // 8, offs_n, n_ok, ssn, ssk, S_BK, TRANS)
            acc_up = _step(cols, up_w, s_up, word, w_ok, offs_n, n_ok, swn, swk, acc_up, magic,
                           F32_DOT, TRANS)
            s_up = s_next
    if TRANS:
        acc, acc_up = tl.trans(acc), tl.trans(acc_up)
    return acc, acc_up
