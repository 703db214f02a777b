"""W4A8 prefill matmul on Hopper's FP8 warpgroup MMA (measured: 0.36-0.45x of torch._scaled_mm
row-wise at 512-8192 rows, slower than W4A16; see docs/benchmarks.md).

The product is computed transposed like int4_wgmma, outᵀ = W · xᵀ: the weights' codes - 8 are
the e4m3 register A operand (k_width 4), built from int4_linear's words unchanged; x's e4m3
codes are permuted within 32-input blocks so the words' nibbles line up (position
16a+4t+2b+c holds input 16a+8b+2t+c). Per group, the products are scaled by the group's
scales; the per-row x scale multiplies at the end. Symmetric weights only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from frugal.ops.triton.launch import enter
from frugal.ops.triton.split_k import finish
from frugal.quant.fp8 import FP8


@gluon.jit
def _operand(words, LAYOUT: gl.constexpr):
    """words [S, 2 (h), 8 (g), 4 (t), 1] int32 of rows 16 s + 8 h + g -> [16 S, 32] e4m3 codes
    - 8 in LAYOUT (the 8-bit wgmma A operand, k_width 4): position 16 a + 4 t + 2 b + c holds
    input 16 a + 8 b + 2 t + c (nibble (2 a + b) + 4 c of word t)."""
    u = words.to(gl.uint32, bitcast=True)
    s1 = (u >> 4).to(gl.int32, bitcast=True)
    s2 = (u >> 8).to(gl.int32, bitcast=True)
    s3 = (u >> 12).to(gl.int32, bitcast=True)
    j = gl.join(gl.join(words, s2), gl.join(s1, s3))  # [S, h, g, t, 1, 2 (a), 2 (b)]
    j = gl.join(j, j)  # [..., a, b, 2 (c)]: registers c, b fastest (one pack of 4)
    codes = gl.inline_asm_elementwise(
        "{.reg .b32 lo, hi, c; .reg .b16 l, h; mov.b32 c, 0x64086408; "
        "lop3.b32 lo, $1, 0x000F000F, 0x64006400, 0xEA; sub.f16x2 lo, lo, c; "
        "lop3.b32 hi, $3, 0x000F000F, 0x64006400, 0xEA; sub.f16x2 hi, hi, c; "
        "cvt.rn.satfinite.e4m3x2.f16x2 l, lo; cvt.rn.satfinite.e4m3x2.f16x2 h, hi; "
        "mov.b32 $0, {l, h};}",
        "=r,r,r,r,r", [j], dtype=gl.float8e4nv, is_pure=True, pack=4)
    codes = gl.permute(codes, (0, 1, 2, 4, 5, 3, 6, 7))  # [S, h, g, 1, a, t, b, c]
    BN: gl.constexpr = 16 * words.shape[0]
    return gl.convert_layout(gl.reshape(codes, (BN, 32)), LAYOUT, assert_trivial=True)


@gluon.jit
def _quarters(words):
    """A tile's words [S, 2, 8, 4 (t), 4 (q)] -> the four [S, 2, 8, 4, 1] of q = 0..3."""
    w = gl.reshape(words, (words.shape[0], 2, 8, 4, 2, 2))  # q = 2 q1 + q0
    lo, hi = gl.split(gl.permute(w, (0, 1, 2, 3, 5, 4)))  # q1 = 0, 1
    q0, q1 = gl.split(lo)
    q2, q3 = gl.split(hi)
    return (gl.expand_dims(q0, 4), gl.expand_dims(q1, 4), gl.expand_dims(q2, 4),
            gl.expand_dims(q3, 4))


@gluon.jit
def _params(pair, dtype: gl.constexpr):
    """A group's (scale, min) pairs (int32: scale in the low half, both in dtype) -> fp32."""
    scale = pair.to(gl.int16).to(dtype, bitcast=True).to(gl.float32)
    low = (pair >> 16).to(gl.int16).to(dtype, bitcast=True).to(gl.float32)
    return scale, low


@gluon.jit
def _chunk(x_smem, stage, c: gl.constexpr):
    """Inputs 32 c.. of a stage's tile as the B operand [32, BM] (x_smem [STAGES, 4 BM, 32]:
    chunk c in rows c BM..)."""
    BM: gl.constexpr = x_smem.shape[1] // 4
    return x_smem.index(stage).slice(c * BM, BM).permute((1, 0))


@gluon.jit
def _tile(words, words_up, x_smem, stage, p_smem, acc, acc_up, GATED: gl.constexpr,
          G: gl.constexpr, dtype: gl.constexpr, a_layout: gl.constexpr,
          acc_layout: gl.constexpr):
    """acc (acc_up) [BN, BM] + one 128-input tile: per group, its 32-input chunks' MMAs (codes
    - 8 against x's e4m3 codes) issued together, waited for, scaled by the group's scales."""
    CHUNKS: gl.constexpr = 4 // G
    quarters = _quarters(words)
    quarters_up = quarters
    if GATED:
        quarters_up = _quarters(words_up)
    for g in gl.static_range(G):
        part = gl.zeros_like(acc)
        part_up = gl.zeros_like(acc)
        for c in gl.static_range(CHUNKS):
            x_b = _chunk(x_smem, stage, g * CHUNKS + c)
            part = warpgroup_mma(_operand(quarters[g * CHUNKS + c], a_layout), x_b, part,
                                 is_async=True)
            if GATED:
                part_up = warpgroup_mma(_operand(quarters_up[g * CHUNKS + c], a_layout), x_b,
                                        part_up, is_async=True)
        if GATED:
            part, part_up = warpgroup_mma_wait(0, deps=[part, part_up])
            scale, _ = _params(p_smem.slice(G + g, 1).permute((1, 0)).load(acc_layout), dtype)
            acc_up = acc_up + part_up * scale
        else:
            part = warpgroup_mma_wait(0, deps=[part])
        scale, _ = _params(p_smem.slice(g, 1).permute((1, 0)).load(acc_layout), dtype)
        acc = acc + part * scale
    return acc, acc_up


@gluon.jit(do_not_specialize=["M"])
def _kernel(x_ptr, s_ptr, w_ptr, p_ptr, b_ptr, r_ptr, out_ptr, part_ptr, count_ptr, M, N,
            KP: gl.constexpr, GROUP: gl.constexpr, GATED: gl.constexpr, HAS_BIAS: gl.constexpr,
            HAS_RESIDUAL: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
            WARPS: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr):
    """out [BLOCK_M rows of x from program_id(1), BLOCK_N outputs] = epilogue(s_x · Σ_g scale_g
    Σ q (u - 8)): x_ptr [M, KP] e4m3 codes in the operand order (see _operand), s_ptr [M] fp32
    per-row scales; w, p as int4_linear's Int4Tiles (symmetric weights only)."""
    GK: gl.constexpr = GROUP if GROUP < 128 else 128
    G: gl.constexpr = 128 // GK
    TILES_PER_GROUP: gl.constexpr = GROUP // 128 if GROUP > 128 else 1
    HALVES: gl.constexpr = 2 if GATED else 1
    S: gl.constexpr = BLOCK_N // 16
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_M, 32])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4)
    w_layout: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1, 4], [1, 1, 8, 4, 1],
                                              [WARPS, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    x_layout: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [WARPS, 1], [1, 0])  # [4 BM, 32]
    p_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, WARPS], [1, 0])
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES * HALVES, S, 2, 8, 4, 4],
                                       gl.SwizzledSharedLayout(4, 1, 1, [4, 3, 2, 1, 0]))
    x_smem = gl.allocate_shared_memory(
        x_ptr.dtype.element_ty, [STAGES, 4 * BLOCK_M, 32],
        gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8, rank=2))
    p_smem = gl.allocate_shared_memory(gl.int32, [STAGES, HALVES * G, BLOCK_N],
                                       gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    enter(PDL)
    pid_n = gl.program_id(0)
    row0 = gl.program_id(1) * BLOCK_M
    last = KP // 128
    width = 2 * N if GATED else N
    L4: gl.constexpr = gl.SliceLayout(4, w_layout)
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    ws = gl.arange(0, S, gl.SliceLayout(1, L2))
    wh = gl.arange(0, 2, gl.SliceLayout(0, L2))
    wg = gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    wt = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    wq = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(
        3, w_layout)))))
    rows = (pid_n * BLOCK_N + gl.expand_dims(gl.expand_dims(ws * 16, 1) + gl.expand_dims(wh * 8, 0),
                                             2) + gl.expand_dims(gl.expand_dims(wg, 0), 1))
    rows4 = gl.expand_dims(rows, 3)
    w_ptrs = (w_ptr + gl.expand_dims(rows4.to(gl.int64) * (KP // 8)
                                     + gl.expand_dims(gl.expand_dims(gl.expand_dims(wt * 4, 0),
                                                                     1), 2), 4)
              + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(wq, 0), 1), 2), 3))
    w_mask = gl.expand_dims(rows4 < N, 4)
    xr = gl.arange(0, 4 * BLOCK_M, gl.SliceLayout(1, x_layout))  # chunk · BM + row
    x_cols = gl.expand_dims((xr // BLOCK_M) * 32, 1) + gl.expand_dims(
        gl.arange(0, 32, gl.SliceLayout(0, x_layout)), 0)
    x_ptrs = x_ptr + gl.expand_dims((row0 + xr % BLOCK_M).to(gl.int64) * KP, 1) + x_cols
    x_mask = gl.expand_dims(row0 + xr % BLOCK_M < M, 1)
    pr = gl.arange(0, HALVES * G, gl.SliceLayout(1, p_layout))
    pn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, p_layout))
    p_offs = gl.expand_dims((pr // G) * N + (pr % G) * width, 1) + gl.expand_dims(pn, 0)
    p_mask = gl.expand_dims(pn < N, 0)

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=acc_layout)
    acc_up = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=acc_layout)
    for i in gl.static_range(STAGES - 1):
        _issue(i, last, w_ptrs, w_mask, x_ptrs, x_mask, p_ptr + p_offs, p_mask, w_smem, x_smem,
               p_smem.index(i), i, G * width, N * (KP // 8), GATED, TILES_PER_GROUP)
    for t in range(0, last):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        fence_async_shared()
        j = t + STAGES - 1
        _issue(j, last, w_ptrs, w_mask, x_ptrs, x_mask, p_ptr + p_offs, p_mask, w_smem, x_smem,
               p_smem.index(j % STAGES), j % STAGES, G * width, N * (KP // 8), GATED,
               TILES_PER_GROUP)
        stage = t % STAGES
        words = w_smem.index(stage * HALVES).load(w_layout)
        words_up = words
        if GATED:
            words_up = w_smem.index(stage * HALVES + 1).load(w_layout)
        acc, acc_up = _tile(words, words_up, x_smem, stage, p_smem.index(stage), acc, acc_up,
                            GATED, G, out_ptr.dtype.element_ty, a_layout, acc_layout)
    async_copy.wait_group(0)
    acc = gl.permute(acc, (1, 0))
    acc_up = gl.permute(acc_up, (1, 0))
    out_layout: gl.constexpr = acc.type.layout
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, out_layout))
    offs_m = row0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, out_layout))
    s_x = gl.expand_dims(gl.load(s_ptr + offs_m, mask=offs_m < M, other=0.0), 1)
    finish(acc * s_x, acc_up * s_x, offs_m, offs_n, offs_m < M, offs_n < N, M, N, part_ptr,
           count_ptr, b_ptr, r_ptr, out_ptr, GATED, HAS_BIAS, HAS_RESIDUAL, 1)


@gluon.jit
def _issue(t, last, w_ptrs, w_mask, x_ptrs, x_mask, p_ptrs, p_mask, w_smem, x_smem, p_dst, stage,
           P_STRIDE, UP, GATED: gl.constexpr, TILES_PER_GROUP: gl.constexpr):
    live = t < last
    if GATED:
        async_copy.async_copy_global_to_shared(w_smem.index(2 * stage), w_ptrs + t * 16,
                                               mask=w_mask & live)
        async_copy.async_copy_global_to_shared(w_smem.index(2 * stage + 1),
                                               w_ptrs + UP + t * 16, mask=w_mask & live)
    else:
        async_copy.async_copy_global_to_shared(w_smem.index(stage), w_ptrs + t * 16,
                                               mask=w_mask & live)
    async_copy.async_copy_global_to_shared(x_smem.index(stage), x_ptrs + t * 128,
                                           mask=x_mask & live)
    async_copy.async_copy_global_to_shared(p_dst, p_ptrs + (t // TILES_PER_GROUP) * P_STRIDE,
                                           mask=p_mask & live)
    async_copy.commit_group()


@triton.jit(do_not_specialize=["M"])
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, KP, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    pos = tl.arange(0, BLOCK)
    k = pos % 32
    inp = pos - k + 16 * (k // 16) + 8 * ((k % 4) // 2) + 2 * ((k % 16) // 4) + k % 2
    x = tl.load(x_ptr + m.to(tl.int64) * K + inp, mask=(inp < K) & (m < M), other=0.0)
    x = x.to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12), 448.0)
    q = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)
    tl.store(q_ptr + m.to(tl.int64) * KP + pos, q.to(q_ptr.dtype.element_ty), mask=pos < KP)
    tl.store(s_ptr + m, scale)


def quantize(x: torch.Tensor):
    m, k = x.shape
    kp = triton.cdiv(k, 128) * 128
    rows = triton.cdiv(m, 16) * 16
    q = torch.empty(rows, kp, dtype=FP8, device=x.device)
    s = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(kp)
    _quantize_kernel[(rows,)](x, q, s, m, k, kp, BLOCK=block, num_warps=8 if block >= 8192 else 4)
    return q, s
