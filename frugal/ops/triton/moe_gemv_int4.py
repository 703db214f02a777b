"""INT4 experts' words widened on the CUDA cores for moe_gemv's K loop: a step's words and
group scales loaded (one or both halves of a gated matrix), its inputs laid out by nibble, and
the group sums (the layout: quant.experts.Int4Experts, 8 nibbles a word, a scale per group of
32 inputs or more)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int4_load(w_base, s_base, k0, K, offs_n, n_ok, swn, swk, ssn, ssk, S_BK: tl.constexpr,
              GROUPS: tl.constexpr):
    """The words [1, BLOCK_N, GROUPS, 4] (int32: word q of a group holds its inputs 8q .. 8q+7,
    a nibble each) and the scales [BLOCK_N, GROUPS] of inputs k0 .. k0 + 32 · GROUPS; zeros
    past K (a load past the end reads nothing)."""
    group = k0 // 32 + tl.arange(0, GROUPS)
    g_ok = group < K // 32
    word = group[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :]
    ok = n_ok[None, :, None, None] & g_ok[None, None, :, None]
    words = tl.load(w_base + offs_n[None, :, None, None] * swn + word * swk, mask=ok, other=0)
    s = tl.load(s_base + offs_n[:, None] * ssn + (group * 32 // S_BK)[None, :] * ssk,
                mask=n_ok[:, None] & g_ok[None, :], other=0.0)
    return words, s


@triton.jit
def int4_pair(w_base, s_base, k0, K, N, offs_n, n_ok, swn, swk, ssn, ssk, S_BK: tl.constexpr,
              GROUPS: tl.constexpr, GATED: tl.constexpr):
    """int4_load's words and scales of the rows offs_n and, GATED, of their up rows (N on);
    not GATED, the same rows twice (loaded once)."""
    w, s = int4_load(w_base, s_base, k0, K, offs_n, n_ok, swn, swk, ssn, ssk, S_BK, GROUPS)
    w_up, s_up = w, s
    if GATED:
        w_up, s_up = int4_load(w_base, s_base, k0, K, offs_n + N, n_ok, swn, swk, ssn, ssk,
                                S_BK, GROUPS)
    return w, s, w_up, s_up


@triton.jit
def int4_inputs(a_row, k0, K, GROUPS: tl.constexpr):
    """Inputs k0 .. k0 + 32 · GROUPS as a [8 (j), 1, GROUPS, 4 (q)] fp32 (k = 32 · group + 8 · q
    + j: nibble j of the group's word q), and 1.5 · their sum over each group [GROUPS]."""
    group = k0 // 32 + tl.arange(0, GROUPS)
    g_ok = group < K // 32
    k = (group[None, None, :, None] * 32 + tl.arange(0, 4)[None, None, None, :] * 8
         + tl.arange(0, 8)[:, None, None, None])
    a = tl.load(a_row + k, mask=g_ok[None, None, :, None], other=0.0).to(tl.float32)
    return a, tl.sum(tl.sum(tl.sum(a, axis=0), axis=0), axis=1) * 1.5


@triton.jit
def int4_sum(words, s, a, a_sum, magic):
    """[BLOCK_N, GROUPS] fp32: for each output and group of 32 inputs, Σ_k a_k · (u_k - 8) / 16
    times the group's scale (words, s: int4_load's; a, a_sum: int4_inputs').
    A nibble becomes the fp32 1 + u/16 in two integer instructions: rotated to bits 19-22 (the
    top of the mantissa; one funnel shift) and put into 1.0's bits (one LOP3 with `magic`,
    0x3F800000, a register so the AND and the OR fuse). Σ a (1 + u/16) - 1.5 Σ a is
    Σ a (u - 8) / 16: the offset leaves per group, not per weight."""
    u = words.to(tl.uint32, bitcast=True)
    rot = ((tl.arange(0, 8) * 4 + 13) % 32).to(tl.uint32)[:, None, None, None]
    f = ((((u >> rot) | (u << (32 - rot))) & 0x780000) | magic).to(tl.float32, bitcast=True)
    part = tl.sum(tl.sum(f * a, axis=0), axis=2) - a_sum[None, :]
    return part * s.to(tl.float32)
