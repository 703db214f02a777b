"""The W4A16 matmul kernel for decode batches (up to 64 rows) on Hopper's warpgroup MMA, in
Gluon, reading int4_linear's layout (see there).

The product is computed transposed, outᵀ = W · xᵀ: the weights are the A operand, dequantized
in registers (wgmma takes A from registers), and x's rows are the B operand's N (8 to 64), read
by the tensor cores straight from shared memory. A decode batch of one to eight rows fills an
m64n8k16 instruction with useful work (mma.sync's m16 would be 1/16 used at one row).

This module moves the data: tiles of 128 inputs stream through shared memory in a STAGES-deep
cp.async ring (the loop unrolled by STAGES where that measured faster: stages, offsets and MMA
descriptors constants); split-K partial sums are reduced by the last program of an output block
(split_k.finish; the splits on grid axis 2). What one tile computes, from operands made of the
words in registers to the scales folded in, is int4_wgmma_tile's.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from frugal.ops.triton.int4_wgmma_tile import tile
from frugal.ops.triton.launch import enter
from frugal.ops.triton.split_k import finish

_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # (Triton 3.7 renamed it)


@gluon.jit(do_not_specialize=["M"])  # (M, the rows, changes from step to step)
def _int4_wgmma(x_ptr, w_ptr, p_ptr, b_ptr, r_ptr, out_ptr, part_ptr, count_ptr, M, N, K_PARTS,
                KP: gl.constexpr, GROUP: gl.constexpr, GATED: gl.constexpr, HAS_BIAS: gl.constexpr,
                HAS_RESIDUAL: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT_K: gl.constexpr,
                OFFSET: gl.constexpr, EVEN_K: gl.constexpr, K_ALIGN: gl.constexpr,
                BLOCK_M: gl.constexpr, WARPS: gl.constexpr, STAGES: gl.constexpr,
                UNROLL: gl.constexpr, CENTERED: gl.constexpr, PDL: gl.constexpr):
    """out = epilogue(x @ wᵀ) for one block of BLOCK_N outputs (all BLOCK_M rows, 8 to 64) over
    this program's share of the 128-input tiles (grid axis 2; SPLIT_K > 1: reduced by the last).
    x: [M, K] with K = K_PARTS · K_ALIGN; w: [N (2N if GATED), K] as int4_linear's Int4Tiles,
    p_ptr its (scale, min) pairs as int32 [KP / GROUP, N (2N)] (CENTERED: its scales as int16).
    BLOCK_N: a multiple of 16 · WARPS (WARPS a multiple of 4). CENTERED: symmetric codes,
    multiplied as code - 8 (no Σ x).
    UNROLL: tiles a step of the loop takes, 1 or STAGES (then every stage is a constant: fewer
    instructions a tile, more registers)."""
    K = K_PARTS * K_ALIGN  # (so the compiler knows x's rows allow 16- or 4-byte copies)
    enter(PDL)
    pid_n = gl.program_id(0)
    xr, x_cols = inputs(BLOCK_M, WARPS)
    x_ptrs = x_ptr + gl.expand_dims((xr % BLOCK_M) * K, 1) + x_cols
    x_mask = gl.expand_dims(xr % BLOCK_M < M, 1)
    acc, acc_up = products(x_ptrs, x_mask, x_cols, K, w_ptr, p_ptr, pid_n, N, KP, GROUP, GATED,
                           BLOCK_N, BLOCK_M, WARPS, STAGES, UNROLL, CENTERED, OFFSET, EVEN_K,
                           SPLIT_K)
    out_layout: gl.constexpr = acc.type.layout
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, out_layout))
    offs_m = gl.arange(0, BLOCK_M, gl.SliceLayout(1, out_layout))
    finish(acc, acc_up, offs_m, offs_n, offs_m < M, offs_n < N, M, N, part_ptr, count_ptr, b_ptr,
           r_ptr, out_ptr, GATED, HAS_BIAS, HAS_RESIDUAL, SPLIT_K)


@gluon.jit
def inputs(BLOCK_M: gl.constexpr, WARPS: gl.constexpr):
    """What a stage holds of x, in the layout its copies take: xr [4 BM] (chunk · BM + row: the
    row is the caller's to map to one of x) and x_cols [4 BM, 32] (the tile's input)."""
    x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [WARPS, 1], [1, 0])
    xr = gl.arange(0, 4 * BLOCK_M, gl.SliceLayout(1, x_layout))
    x_cols = gl.expand_dims((xr // BLOCK_M) * 32, 1) + gl.expand_dims(
        gl.arange(0, 32, gl.SliceLayout(0, x_layout)), 0)
    return xr, x_cols


@gluon.jit
def products(x_ptrs, x_mask, x_cols, K, w_ptr, p_ptr, pid_n, N, KP: gl.constexpr,
             GROUP: gl.constexpr, GATED: gl.constexpr, BLOCK_N: gl.constexpr,
             BLOCK_M: gl.constexpr, WARPS: gl.constexpr, STAGES: gl.constexpr,
             UNROLL: gl.constexpr, CENTERED: gl.constexpr, OFFSET: gl.constexpr,
             EVEN_K: gl.constexpr, SPLIT_K: gl.constexpr):
    """The fp32 sums [BLOCK_M, BLOCK_N] (acc, and acc_up if GATED) of outputs pid_n · BLOCK_N..
    of weights w_ptr / p_ptr (int4_linear's words and (scale, min) pairs, CENTERED: scales)
    times the BLOCK_M rows
    x_ptrs reads (tile 0's, from `inputs`; x_mask: the live rows), over this program's share of
    the 128-input tiles (grid axis 2 of SPLIT_K): the ring and the loop the module describes."""
    ASYNC: gl.constexpr = BLOCK_M <= 16 or CENTERED  # a group's MMAs issued together
    GK: gl.constexpr = GROUP if GROUP < 128 else 128  # inputs per scale within a tile
    G: gl.constexpr = 128 // GK
    TILES_PER_GROUP: gl.constexpr = GROUP // 128 if GROUP > 128 else 1
    HALVES: gl.constexpr = 2 if GATED else 1
    S: gl.constexpr = BLOCK_N // 16  # 16-row slabs
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    # words [S, 2 (h), 8 (g), 4 (t), 4 (q)] of rows 16 s + 8 h + g: lane = 4 g + t, slabs on
    # warps (as the A fragment wants), a thread's four words one 16-byte copy
    w_layout: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1, 4], [1, 1, 8, 4, 1],
                                              [WARPS, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    # (scale, min) pairs: one 4-byte copy each; a centered weight's 16-bit scales two a copy
    P_VEC: gl.constexpr = 2 if CENTERED else 1
    p_layout: gl.constexpr = gl.BlockedLayout([1, P_VEC], [1, 32], [1, WARPS], [1, 0])
    x_dtype: gl.constexpr = x_ptrs.dtype.element_ty
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES * HALVES, S, 2, 8, 4, 4],
                                       gl.SwizzledSharedLayout(4, 1, 1, [4, 3, 2, 1, 0]))
    x_smem = gl.allocate_shared_memory(
        x_dtype, [STAGES, 4 * BLOCK_M, 32],
        gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2))
    p_smem = gl.allocate_shared_memory(p_ptr.dtype.element_ty, [STAGES, HALVES * G, BLOCK_N],
                                       gl.SwizzledSharedLayout(P_VEC, 1, 1, [1, 0]))
    per = gl.cdiv(KP // 128, SPLIT_K)
    first = gl.program_id(2) * per
    last = gl.minimum(first + per, KP // 128)
    width = 2 * N if GATED else N

    # what tile 0 copies: a thread's four words of each row, the (scale, min) pairs (scales)
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
    rows4 = gl.expand_dims(rows, 3)  # [S, 2, 8, 1]
    wt5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(wt * 4, 0), 1), 2), 4)
    wq5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(wq, 0), 1), 2), 3)
    cols = wt5 + wq5  # [1, 1, 1, 4, 4]: a thread's words in its rows' tiles
    w_ptrs = w_ptr + gl.expand_dims(row_offsets(rows4, KP), 4) + cols  # tile 0's words
    w_up = w_ptrs  # (GATED: the up half's rows N.. of the same outputs)
    if GATED:
        w_up = w_ptr + gl.expand_dims(row_offsets(rows4 + N, KP), 4) + cols
    w_mask = gl.expand_dims(rows4 < N, 4)
    pr = gl.arange(0, HALVES * G, gl.SliceLayout(1, p_layout))  # half · G + group
    pn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, p_layout))
    p_offs = gl.expand_dims((pr // G) * N + (pr % G) * width, 1) + gl.expand_dims(pn, 0)
    p_mask = gl.expand_dims(pn < N, 0)

    ones = gl.full([BLOCK_N, 32], 1.0, x_dtype, layout=a_layout)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=acc_layout)
    acc_up = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=acc_layout)
    for i in gl.static_range(STAGES - 1):
        _issue(first + i, last, w_ptrs, w_up, w_mask, x_ptrs, x_mask, x_cols, K, p_ptr + p_offs,
               p_mask, w_smem, x_smem, p_smem.index(i), i, G * width, GATED, EVEN_K,
               TILES_PER_GROUP)
    for t0 in range(first, last, UNROLL):
        for u in gl.static_range(UNROLL):
            t = t0 + u
            if t < last:
                async_copy.wait_group(STAGES - 2)  # tile t has landed (own copies) ...
                _barrier()  # ... everyone's, and the stage refilled below is unread
                fence_async_shared()  # (the tensor cores read x through the async proxy)
                if UNROLL == STAGES:  # (the stages are constants)
                    stage = u
                    refill = (u + STAGES - 1) % STAGES
                else:
                    stage = (t - first) % STAGES
                    refill = (t - first + STAGES - 1) % STAGES
                _issue(t + STAGES - 1, last, w_ptrs, w_up, w_mask, x_ptrs, x_mask, x_cols, K,
                       p_ptr + p_offs, p_mask, w_smem, x_smem, p_smem.index(refill), refill,
                       G * width, GATED, EVEN_K, TILES_PER_GROUP)
                words = w_smem.index(stage * HALVES).load(w_layout)
                words_up = w_smem.index(stage * HALVES + 1).load(w_layout) if GATED else words
                acc, acc_up = tile(words, words_up, x_smem, stage, p_smem.index(stage), ones,
                                    acc, acc_up, GATED, G, OFFSET, a_layout, acc_layout, ASYNC,
                                    CENTERED)
    async_copy.wait_group(0)
    acc = gl.permute(acc, (1, 0))  # [BM, BN], as the epilogue wants
    acc_up = gl.permute(acc_up, (1, 0))
    return acc, acc_up


@triton.jit
def row_offsets(rows, KP: tl.constexpr):
    """Where tile 0 of weight rows `rows` starts in int4_linear's words (row blocks of 64, a
    block's tiles 1024 words apart); plain tl, so the dequantize kernel calls it too."""
    return (rows // 64).to(tl.int64) * (KP * 8) + (rows % 64) * 16


@gluon.jit
def _issue(t, last, w_ptrs, w_up, w_mask, x_ptrs, x_mask, x_cols, K, p_ptrs, p_mask, w_smem,
           x_smem, p_dst, stage, P_STRIDE, GATED: gl.constexpr, EVEN_K: gl.constexpr,
           TILES_PER_GROUP: gl.constexpr):
    """Start copying tile t's words (w_up: the up half's; see row_offsets), inputs and (scale,
    min) pairs into a stage (one group of copies; none at or past `last`)."""
    live = t < last
    if GATED:
        async_copy.async_copy_global_to_shared(w_smem.index(2 * stage), w_ptrs + t * 1024,
                                               mask=w_mask & live)
        async_copy.async_copy_global_to_shared(w_smem.index(2 * stage + 1), w_up + t * 1024,
                                               mask=w_mask & live)
    else:
        async_copy.async_copy_global_to_shared(w_smem.index(stage), w_ptrs + t * 1024,
                                               mask=w_mask & live)
    x_live = x_mask & live
    if not EVEN_K:
        x_live = x_live & (x_cols + t * 128 < K)
    async_copy.async_copy_global_to_shared(x_smem.index(stage), x_ptrs + t * 128, mask=x_live)
    async_copy.async_copy_global_to_shared(p_dst, p_ptrs + (t // TILES_PER_GROUP) * P_STRIDE,
                                           mask=p_mask & live)
    async_copy.commit_group()
