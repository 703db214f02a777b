"""INT4 experts in the small-batch GEMV (moe_gemv, MODE 2): a K step's words, scales and
inputs, and its per-group partial sums, for either layout of the experts' words.

quant.experts.Int4Experts: [E, N, K / 8] words, word q of a group of 32 inputs holding inputs
8q .. 8q + 7 (nibble j: input 8q + j); the four words of a group contiguous.
moe_int4_wgmma.Int4ExpertTiles (TILES): int4_linear's layout, rows in blocks of 64, a row's
16 words of a 128-input tile contiguous (64 bytes); word 4t + q holds inputs 32q + 16a + 8b +
2t + c (group 4 · tile + q) in nibble (2a + b) + 4c. A step then loads whole tiles (BLOCK_K a
multiple of 128) as [1, BLOCK_N, tiles, 4 (t), 4 (q)], one run of 16 words a row, and its
inputs in the same order; the sums over a group are over (j, t). swn is then the words of a
block of 64 rows (Kp · 8) and the scales (scale, min) pairs: ssn 2, ssk 2 · rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from frugal.ops.triton.int4_wgmma import row_offsets


@triton.jit
def int4_load(w_base, s_base, k0, K, offs_n, n_ok, swn, swk, ssn, ssk, S_BK: tl.constexpr,
               GROUPS: tl.constexpr, TILES: tl.constexpr):
    """The words [1, BLOCK_N, GROUPS, 4] (int32: word q of a group holds its inputs 8q .. 8q+7,
    a nibble each; TILES: [1, BLOCK_N, GROUPS / 4, 4 (t), 4 (q)], see the module docstring)
    and the scales [BLOCK_N, GROUPS] of inputs k0 .. k0 + 32 · GROUPS; zeros past K (a load
    past the end reads nothing)."""
    group = k0 // 32 + tl.arange(0, GROUPS)
    g_ok = group < K // 32
    if TILES:
        tile = k0 // 128 + tl.arange(0, GROUPS // 4)
        word = ((row_offsets(offs_n, swn // 8))[None, :, None, None, None]
                + tile[None, None, :, None, None] * 1024
                + tl.arange(0, 4)[None, None, None, :, None] * 4
                + tl.arange(0, 4)[None, None, None, None, :])
        ok = n_ok[None, :, None, None, None] & (tile < swn // 1024)[None, None, :, None, None]
        words = tl.load(w_base + word, mask=ok, other=0)
    else:
        word = group[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :]
        ok = n_ok[None, :, None, None] & g_ok[None, None, :, None]
        words = tl.load(w_base + offs_n[None, :, None, None] * swn + word * swk, mask=ok,
                        other=0)
    s = tl.load(s_base + offs_n[:, None] * ssn + (group * 32 // S_BK)[None, :] * ssk,
                mask=n_ok[:, None] & g_ok[None, :], other=0.0)
    return words, s


@triton.jit
def int4_pair(w_base, s_base, k0, K, N, offs_n, n_ok, swn, swk, ssn, ssk, S_BK: tl.constexpr,
               GROUPS: tl.constexpr, GATED: tl.constexpr, TILES: tl.constexpr):
    """int4_load's words and scales of the rows offs_n and, GATED, of their up rows (N on);
    not GATED, the same rows twice (loaded once)."""
    w, s = int4_load(w_base, s_base, k0, K, offs_n, n_ok, swn, swk, ssn, ssk, S_BK, GROUPS,
                      TILES)
    w_up, s_up = w, s
    if GATED:
        w_up, s_up = int4_load(w_base, s_base, k0, K, offs_n + N, n_ok, swn, swk, ssn, ssk,
                                S_BK, GROUPS, TILES)
    return w, s, w_up, s_up


@triton.jit
def int4_inputs(a_row, k0, K, GROUPS: tl.constexpr, TILES: tl.constexpr):
    """Inputs k0 .. k0 + 32 · GROUPS as a [8 (j), 1, GROUPS, 4 (q)] fp32 (k = 32 · group + 8 · q
    + j: nibble j of the group's word q; TILES: [8 (j), 1, GROUPS / 4, 4 (t), 4 (q)], nibble j
    of word 4t + q), and 1.5 · their sum over each group [GROUPS]."""
    if TILES:
        tile = k0 // 128 + tl.arange(0, GROUPS // 4)
        j = tl.arange(0, 8)[:, None, None, None, None]
        k = (tile[None, None, :, None, None] * 128 + tl.arange(0, 4)[None, None, None, None, :] * 32
             + ((j >> 1) & 1) * 16 + (j & 1) * 8 + tl.arange(0, 4)[None, None, None, :, None] * 2
             + (j >> 2))
        a = tl.load(a_row + k, mask=k < K, other=0.0).to(tl.float32)
        a_sum = tl.sum(tl.sum(tl.sum(a, axis=0), axis=0), axis=1)  # [GROUPS / 4, 4 (q)]
        a_sum = tl.reshape(a_sum, (GROUPS,))
    else:
        group = k0 // 32 + tl.arange(0, GROUPS)
        g_ok = group < K // 32
        k = (group[None, None, :, None] * 32 + tl.arange(0, 4)[None, None, None, :] * 8
             + tl.arange(0, 8)[:, None, None, None])
        a = tl.load(a_row + k, mask=g_ok[None, None, :, None], other=0.0).to(tl.float32)
        a_sum = tl.sum(tl.sum(tl.sum(a, axis=0), axis=0), axis=1)
    return a, a_sum * 1.5


@triton.jit
def int4_sum(words, s, a, a_sum, magic, TILES: tl.constexpr):
    """[BLOCK_N, GROUPS] fp32: for each output and group of 32 inputs, Σ_k a_k · (u_k - 8) / 16
    times the group's scale (words, s: int4_load's; a, a_sum: int4_inputs').
    A nibble becomes the fp32 1 + u/16 in two integer instructions: rotated to bits 19-22 (the
    top of the mantissa; one funnel shift) and put into 1.0's bits (one LOP3 with `magic`,
    0x3F800000, a register so the AND and the OR fuse). Σ a (1 + u/16) - 1.5 Σ a is
    Σ a (u - 8) / 16: the offset leaves per group, not per weight."""
    u = words.to(tl.uint32, bitcast=True)
    if TILES:  # (words [1, BN, tiles, 4 (t), 4 (q)]: a group's sum over j and t)
        rot = ((tl.arange(0, 8) * 4 + 13) % 32).to(tl.uint32)[:, None, None, None, None]
        f = ((((u >> rot) | (u << (32 - rot))) & 0x780000) | magic).to(tl.float32, bitcast=True)
        part = tl.sum(tl.sum(f * a, axis=0), axis=2)  # [BN, tiles, 4 (q)]
        part = tl.reshape(part, (part.shape[0], part.shape[1] * 4))
    else:
        rot = ((tl.arange(0, 8) * 4 + 13) % 32).to(tl.uint32)[:, None, None, None]
        f = ((((u >> rot) | (u << (32 - rot))) & 0x780000) | magic).to(tl.float32, bitcast=True)
        part = tl.sum(tl.sum(f * a, axis=0), axis=2)
    return (part - a_sum[None, :]) * s.to(tl.float32)
