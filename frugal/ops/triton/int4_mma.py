"""The W4A16 matmul kernel for decode batches (up to 64 rows), on the tensor cores, in Gluon
(Triton's language with explicit layouts), reading int4_linear's layout (see there).

Each warp owns 8-output column strips of an mma.sync m16n8k16 accumulator; for every strip and
k16 block a thread needs the bf16 pairs at inputs (2t, 2t+1) and (2t+8, 2t+9) (t = lane % 4).
The layout puts exactly those codes, for two k16 blocks, in one 32-bit word, two codes of a pair
16 bits apart, so one shift and one LOP3 turn a word into a ready operand register (bits
MAGIC | code: the number OFFSET + code): the joins and the permute in `_operand` only rename
registers, which `convert_layout(..., assert_trivial=True)` checks when the kernel compiles.
A thread loads its four words of a 128-input tile with one 16-byte copy. Tiles stream through
shared memory in a STAGES-deep cp.async ring (words, the tile's inputs, scales and mins), so
that many tiles are in flight per SM. OFFSET comes back per group from Σx (an mma with ones):
Σ_k x_k w_k = scale · Σ x (OFFSET + u) + (min - OFFSET · scale) · Σ x. Split-K partial sums are
reduced by the last program of an output block (as split_k.finish).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from frugal.ops.triton.launch import enter
from frugal.ops.triton.split_k import epilogue


@gluon.jit
def _operand(words, LAYOUT: gl.constexpr, dtype: gl.constexpr):
    """words [BN, 4 (t), Q] int32 -> [32 Q, BN] in dtype (OFFSET + code) in LAYOUT (the mma B
    operand): input 32 q + 16 a + 8 b + 2 t + c from nibble (2 a + b) + 4 c of word (t, q)."""
    u = words.to(gl.uint32, bitcast=True)
    s1 = (u >> 4).to(gl.int32, bitcast=True)
    s2 = (u >> 8).to(gl.int32, bitcast=True)
    s3 = (u >> 12).to(gl.int32, bitcast=True)
    j = gl.join(gl.join(words, s1), gl.join(s2, s3))  # [BN, 4, Q, 2 (b), 2 (a)]
    j = gl.join(j, j)  # [BN, 4, Q, b, a, 2 (c)]
    if dtype == gl.bfloat16:
        pairs = gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;",
                                          "=r,r,r", [j], dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        pairs = gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x64006400, 0xEA;",
                                          "=r,r,r", [j], dtype=gl.float16, is_pure=True, pack=2)
    pairs = gl.permute(pairs, (2, 4, 3, 1, 5, 0))  # [Q, a, b, t, c, BN]
    BN: gl.constexpr = words.shape[0]
    K: gl.constexpr = 32 * words.shape[2]
    return gl.convert_layout(gl.reshape(pairs, (K, BN)), LAYOUT, assert_trivial=True)


@gluon.jit
def _group_words(words, g: gl.constexpr, Q: gl.constexpr):
    """The words [BN, 4, Q] of group g of a tile's words [BN, 4, 4] (Q = 4, 2 or 1)."""
    if Q == 4:
        out = words
    else:
        w = gl.permute(gl.reshape(words, (words.shape[0], 4, 2, 2)), (0, 1, 3, 2))  # q0, q1
        lo, hi = gl.split(w)
        if Q == 2:
            if g == 1:
                out = hi
            else:
                out = lo
        else:
            if g < 2:
                a, b = gl.split(lo)
            else:
                a, b = gl.split(hi)
            if g % 2 == 1:
                out = gl.expand_dims(b, 2)
            else:
                out = gl.expand_dims(a, 2)
    return out


@gluon.jit
def _tile_sum(x, words, ones, scale, low, acc, OFFSET: gl.constexpr,
              b_layout: gl.constexpr, MMA: gl.constexpr):
    """acc + one group's products: x [BM, GK] (A operand), words [BN, 4, GK / 32], scale and low
    [1, BN] (its scales and mins)."""
    part = mma_v2(x, _operand(words, b_layout, x.dtype), gl.zeros_like(acc))
    x_sum = gl.max(mma_v2(x, ones, gl.zeros([acc.shape[0], 8], gl.float32, layout=MMA)), axis=1)
    return acc + part * scale + gl.expand_dims(x_sum, 1) * (low - OFFSET * scale)


@gluon.jit
def _params(pair, dtype: gl.constexpr):
    """A group's (scale, min) pairs (int32: scale in the low half, both in dtype) -> fp32."""
    scale = pair.to(gl.int16).to(dtype, bitcast=True).to(gl.float32)
    low = (pair >> 16).to(gl.int16).to(dtype, bitcast=True).to(gl.float32)
    return scale, low


@gluon.jit(do_not_specialize=["M"])  # (M, the rows, changes from step to step)
def _kernel(x_ptr, w_ptr, p_ptr, b_ptr, r_ptr, out_ptr, part_ptr, count_ptr, M, N, K_PARTS,
            KP: gl.constexpr, GROUP: gl.constexpr, GATED: gl.constexpr, HAS_BIAS: gl.constexpr,
            HAS_RESIDUAL: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT_K: gl.constexpr,
            OFFSET: gl.constexpr, EVEN_K: gl.constexpr, K_ALIGN: gl.constexpr,
            BLOCK_M: gl.constexpr, WARPS: gl.constexpr, STAGES: gl.constexpr,
            PDL: gl.constexpr):
    """out = epilogue(x @ wᵀ) for one block of BLOCK_N outputs (all BLOCK_M rows) over this
    program's share of the 128-input tiles (grid axis 1; SPLIT_K > 1: reduced by the last).
    x: [M, K] with K = K_PARTS · K_ALIGN; w: [N (2N if GATED), K] as int4_linear's Int4Tiles,
    p_ptr its (scale, min) pairs as int32 [KP / GROUP, N (2N)]."""
    GK: gl.constexpr = GROUP if GROUP < 128 else 128  # inputs per scale within a tile
    G: gl.constexpr = 128 // GK
    HALVES: gl.constexpr = 2 if GATED else 1
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS],
                                                  instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # words [BN, 4 (t), 4 (q)]: lane = 4 · (n % 8) + t, warps along n, as the B operand wants
    w_layout: gl.constexpr = gl.BlockedLayout([1, 1, 4], [8, 4, 1], [WARPS, 1, 1], [2, 1, 0])
    x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [WARPS, 1], [1, 0])
    p_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, WARPS], [1, 0])
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES * HALVES, BLOCK_N, 4, 4],
                                       gl.SwizzledSharedLayout(4, 1, 1, [2, 1, 0]))
    x_smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BLOCK_M, 128],
                                       gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
    p_smem = gl.allocate_shared_memory(gl.int32, [STAGES, HALVES * G, BLOCK_N],
                                       gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    K = K_PARTS * K_ALIGN  # (so the compiler knows x's rows allow 16- or 4-byte copies)
    enter(PDL)
    pid_n = gl.program_id(0)
    per = gl.cdiv(KP // 128, SPLIT_K)
    first = gl.program_id(1) * per
    last = gl.minimum(first + per, KP // 128)
    width = 2 * N if GATED else N

    # what tile 0 copies: a thread's four words of each row, x's rows, the (scale, min) pairs
    wn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, gl.SliceLayout(2, w_layout)))
    wt = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, w_layout)))
    wq = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, w_layout)))
    w_ptrs = (w_ptr + gl.expand_dims(gl.expand_dims(wn.to(gl.int64) * (KP // 8), 1), 2)
              + gl.expand_dims(gl.expand_dims(wt * 4, 0), 2)
              + gl.expand_dims(gl.expand_dims(wq, 0), 1))
    w_mask = gl.expand_dims(gl.expand_dims(wn < N, 1), 2)
    xm = gl.arange(0, BLOCK_M, gl.SliceLayout(1, x_layout))
    xk = gl.arange(0, 128, gl.SliceLayout(0, x_layout))
    x_ptrs = x_ptr + gl.expand_dims(xm * K, 1) + gl.expand_dims(xk, 0)
    x_mask = gl.expand_dims(xm < M, 1)
    pr = gl.arange(0, HALVES * G, gl.SliceLayout(1, p_layout))  # half · G + group
    pn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, p_layout))
    p_offs = gl.expand_dims((pr // G) * N + (pr % G) * width, 1) + gl.expand_dims(pn, 0)
    p_mask = gl.expand_dims(pn < N, 0)

    ones = gl.full([GK, 8], 1.0, x_ptr.dtype.element_ty, layout=b_layout)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
    acc_up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
    for i in gl.static_range(STAGES - 1):
        _issue(first + i, last, w_ptrs, w_mask, x_ptrs, x_mask, xk, K, p_ptr + p_offs, p_mask,
               w_smem, x_smem.index(i), p_smem.index(i), i, G * width, N * (KP // 8), GATED,
               EVEN_K)
    for t in range(first, last):
        async_copy.wait_group(STAGES - 2)  # tile t has landed (own copies) ...
        gl.thread_barrier()  # ... everyone's, and the stage refilled below is read by no one
        j = t - first + STAGES - 1
        _issue(first + j, last, w_ptrs, w_mask, x_ptrs, x_mask, xk, K, p_ptr + p_offs, p_mask,
               w_smem, x_smem.index(j % STAGES), p_smem.index(j % STAGES), j % STAGES,
               G * width, N * (KP // 8), GATED, EVEN_K)
        stage = (t - first) % STAGES
        words = w_smem.index(stage * HALVES).load(w_layout)
        if GATED:
            words_up = w_smem.index(stage * HALVES + 1).load(w_layout)
        for g in gl.static_range(G):
            x = x_smem.index(stage).slice(g * GK, GK, dim=1).load(a_layout)
            scale, low = _params(p_smem.index(stage).slice(g, 1).load(mma), x.dtype)
            acc = _tile_sum(x, _group_words(words, g, GK // 32), ones, scale, low, acc, OFFSET,
                            b_layout, mma)
            if GATED:
                scale, low = _params(p_smem.index(stage).slice(G + g, 1).load(mma), x.dtype)
                acc_up = _tile_sum(x, _group_words(words_up, g, GK // 32), ones, scale, low,
                                   acc_up, OFFSET, b_layout, mma)
    async_copy.wait_group(0)
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, mma))
    offs_m = gl.arange(0, BLOCK_M, gl.SliceLayout(1, mma))
    mask = gl.expand_dims(offs_m < M, 1) & gl.expand_dims(offs_n < N, 0)
    if SPLIT_K > 1:
        rows = part_ptr + gl.expand_dims(offs_m * width, 1) + gl.expand_dims(offs_n, 0)
        gl.store(rows + gl.program_id(1) * M * width, acc, mask=mask)
        if GATED:
            gl.store(rows + gl.program_id(1) * M * width + N, acc_up, mask=mask)
        gl.thread_barrier()  # every thread's partials stored before the ticket is taken
        ticket = gl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:  # the last to arrive: sum in split order (deterministic)
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
            acc_up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
            for s in gl.static_range(SPLIT_K):  # (.cg: from L2, never a stale L1 line)
                acc += gl.load(rows + s * M * width, mask=mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_up += gl.load(rows + s * M * width + N, mask=mask, other=0.0,
                                      cache_modifier=".cg")
            gl.store(count_ptr + pid_n, 0)
            epilogue(acc, acc_up, offs_m, offs_n, offs_m < M, offs_n < N, N, b_ptr, r_ptr,
                     out_ptr, GATED, HAS_BIAS, HAS_RESIDUAL)
    else:
        epilogue(acc, acc_up, offs_m, offs_n, offs_m < M, offs_n < N, N, b_ptr, r_ptr, out_ptr,
                 GATED, HAS_BIAS, HAS_RESIDUAL)


@gluon.jit
def _issue(t, last, w_ptrs, w_mask, x_ptrs, x_mask, xk, K, p_ptrs, p_mask, w_smem, x_dst, p_dst,
           stage, P_STRIDE, UP, GATED: gl.constexpr, EVEN_K: gl.constexpr):
    """Start copying tile t's words, inputs and (scale, min) pairs into a stage (as one group
    of copies; nothing is read at or past `last`)."""
    live = t < last
    if GATED:
        async_copy.async_copy_global_to_shared(w_smem.index(2 * stage), w_ptrs + t * 16,
                                               mask=w_mask & live)
        async_copy.async_copy_global_to_shared(w_smem.index(2 * stage + 1),
                                               w_ptrs + UP + t * 16, mask=w_mask & live)
    else:
        async_copy.async_copy_global_to_shared(w_smem.index(stage), w_ptrs + t * 16,
                                               mask=w_mask & live)
    x_live = x_mask & live
    if not EVEN_K:
        x_live = x_live & gl.expand_dims(xk + t * 128 < K, 0)
    async_copy.async_copy_global_to_shared(x_dst, x_ptrs + t * 128, mask=x_live)
    async_copy.async_copy_global_to_shared(p_dst, p_ptrs + t * P_STRIDE, mask=p_mask & live)
    async_copy.commit_group()
