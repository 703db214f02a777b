"""Decode attention over an FP8 (e4m3) paged KV cache, on the tensor cores, in Gluon (Triton's
language with explicit layouts). Same contract as attention._decode_kernel with FP8 = True.

One warp per program: one request, one KV head, one slice of the context. The query heads of the
group are the 8 columns of mma.sync m16n8k16 products and the keys (16 per block) their rows:
    Sᵀ [keys, heads] = K [keys, d] · Qᵀ [d, heads]        (K the A operand)
    Oᵀ [d, heads]   += Vᵀ [d, keys] · Pᵀ [keys, heads]     (Vᵀ the A operand: V is key-minor)
so a group of 4 heads pads to 8 columns, not to 16 rows as with the heads as rows.

Every FP8 byte lands in the register that feeds the products. Within a 16-wide k block of a
fragment, lane 4g + t holds index 8a + 2t + c (a, c in {0, 1}); the thread loads, as one 32-bit
word, the four bytes 2a + c of a run of four, and one cvt.rn.f16x2.e4m3x2 per two bytes widens
them: K's d for a key (word w = 16 (j // 4) + 4t + j % 4 of the key's D/4, block j: each
16-byte copy of a warp reads whole 32-byte sectors), V's keys for a d (keys 4t .. 4t + 3 of the
block). Products sum over d and over keys, so the order they are taken in is free: Q is loaded
in the same d order, and the mask maps a row to its key. Pᵀ goes from the accumulator to the B
operand with movmatrix (an 8x8 transpose across the warp's registers). The loads of the next
block are issued before the products of this one.
"""

from __future__ import annotations

import functools
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from frugal.ops.triton.decode_split import split_len
from frugal.ops.triton.launch import enter
from frugal.ops.triton.sizes import cdiv

# 16-key blocks per inner step, and how many of the kernel's warps an SM holds at each
# (registers at d=128: 128, 166, 255). A step splits contexts until its programs fill one such
# wave of warps (measured best on the H200: programs past one wave wait for a second, and
# splits past it only add partials to merge).
PAGES = 2
_WARPS_PER_SM = {1: 16, 2: 12, 4: 8}

_CVT_LO = gl.constexpr("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; cvt.rn.f16x2.e4m3x2 $0, lo; }")
_CVT_HI = gl.constexpr("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; cvt.rn.f16x2.e4m3x2 $0, hi; }")
_TRANSPOSE = gl.constexpr("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;")


def fits(q: torch.Tensor, group: int, head_dim: int, page_size: int) -> bool:
    """Whether this kernel runs a decode: CUDA sm_89+ (FP8 conversions), at most 8 query heads
    per KV head, head_dim a multiple of 64 and page_size of 16."""
    if q.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return (torch.cuda.get_device_capability(q.device) >= (8, 9) and group <= 8
            and head_dim % 64 == 0 and page_size % 16 == 0)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_count(num_requests: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
               most: int) -> int:
    """Context slices per (request, KV head): as many as one wave of the one-warp programs
    holds, each at least one block of keys, at most `most`. Host values only (CUDA-graph
    friendly)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    wave = _num_sms(index) * _WARPS_PER_SM.get(PAGES, 8)
    wanted = wave // max(num_requests * num_kv_heads, 1)
    return max(1, min(wanted, cdiv(max_seq_len, 16 * PAGES), most))


@gluon.jit
def _widen(words):
    """int32 words [...] of four e4m3 bytes -> fp16 [..., 2 (c), 2 (a)] from byte 2a + c."""
    w = gl.join(words, words)
    lo = gl.inline_asm_elementwise(_CVT_LO, "=r,r,r", [w], dtype=gl.float16, is_pure=True,
                                   pack=2)
    hi = gl.inline_asm_elementwise(_CVT_HI, "=r,r,r", [w], dtype=gl.float16, is_pure=True,
                                   pack=2)
    return gl.join(lo, hi)


@gluon.jit
def _load_block(k_ptr, v_ptr, table_ptr, start, last, kv_head, k_offs, v_offs,
                K_LAYOUT: gl.constexpr, V_LAYOUT: gl.constexpr, NUM_KV_HEADS: gl.constexpr,
                HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, PAGES: gl.constexpr):
    """Issue the loads of the block of 16·PAGES keys at `start` (nothing at or past `last`):
    K words [PAGES, 2, 8, 4, D/16] in K_LAYOUT and V words [D/16, 2, 8, PAGES, 4] in V_LAYOUT."""
    kp = gl.arange(0, PAGES, _line(0, K_LAYOUT))
    vp = gl.arange(0, PAGES, _line(3, V_LAYOUT))
    k_live = start + 16 * kp < last
    v_live = start + 16 * vp < last
    k_page = gl.load(table_ptr + (start + 16 * kp) // PAGE_SIZE, mask=k_live, other=0)
    v_page = gl.load(table_ptr + (start + 16 * vp) // PAGE_SIZE, mask=v_live, other=0)
    # in int32 words: K [pages, PAGE_SIZE, kv heads, D / 4], V [pages, kv heads, D, PAGE_SIZE / 4]
    k_base = ((k_page.to(gl.int64) * PAGE_SIZE + (start + 16 * kp) % PAGE_SIZE) * NUM_KV_HEADS
              + kv_head) * (HEAD_DIM // 4)
    v_base = ((v_page.to(gl.int64) * NUM_KV_HEADS + kv_head) * HEAD_DIM * (PAGE_SIZE // 4)
              + (start + 16 * vp) % PAGE_SIZE // 4)
    k = gl.load(k_ptr + (_expand(k_base, 0) + k_offs), mask=_expand(k_live, 0), other=0)
    v = gl.load(v_ptr + (_expand(v_base, 3) + v_offs), mask=_expand(v_live, 3), other=0)
    return k, v


@gluon.constexpr_function
def _line(dim, layout):
    """The rank-1 layout of dimension `dim` of a rank-5 layout (the others sliced away)."""
    for d in reversed([d for d in range(5) if d != dim]):
        layout = gl.SliceLayout(d, layout)
    return layout


@gluon.jit
def _expand(x, DIM: gl.constexpr):
    """x [n] in _line(DIM, L) -> [1, .., n, .., 1] (n at DIM) in L."""
    for d in gl.static_range(5):
        if d != DIM:
            x = gl.expand_dims(x, d)
    return x


@gluon.jit
def _axis(SIZE: gl.constexpr, DIM: gl.constexpr, LAYOUT: gl.constexpr):
    """arange(SIZE) along dimension DIM of a rank-5 LAYOUT, the other dimensions 1."""
    return _expand(gl.arange(0, SIZE, _line(DIM, LAYOUT)), DIM)


@gluon.jit
def _offsets(NUM_KV_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
             K_LAYOUT: gl.constexpr, V_LAYOUT: gl.constexpr):
    """Word offsets of a thread's K words [1, 2 (h), 8 (g), 4 (t), D/16 (j)] from its
    sub-block's first key (row 8h + g is key 4 (g // 2) + 2h + g % 2; word 16 (j // 4) + 4t +
    j % 4), and of its V words [D/16 (i), 2 (h), 8 (g), 1, 4 (t)] (d = 16 i + 8 h + g, keys 4t
    .. 4t + 3)."""
    h = _axis(2, 1, K_LAYOUT)
    g = _axis(8, 2, K_LAYOUT)
    j = _axis(HEAD_DIM // 16, 4, K_LAYOUT)
    key = 4 * (g // 2) + 2 * h + g % 2
    k_offs = (key * (NUM_KV_HEADS * HEAD_DIM // 4) + 4 * _axis(4, 3, K_LAYOUT) + 16 * (j // 4)
              + j % 4)
    d = 16 * _axis(HEAD_DIM // 16, 0, V_LAYOUT) + 8 * _axis(2, 1, V_LAYOUT) + _axis(8, 2, V_LAYOUT)
    v_offs = d * (PAGE_SIZE // 4) + _axis(4, 4, V_LAYOUT)
    return k_offs, v_offs


@gluon.jit
def _step(k_words, v_words, q, start, last, m_i, l_i, acc, qk_scale, PAGES: gl.constexpr,
          MMA: gl.constexpr):
    """Online softmax over one block of 16·PAGES keys (log2 units): Sᵀ = K·Qᵀ, masked past
    `last`, running max m_i and sum l_i per head [8], Oᵀ acc [D, 8]."""
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    D: gl.constexpr = acc.shape[0]
    N: gl.constexpr = 16 * PAGES
    k = gl.permute(_widen(k_words), (0, 1, 2, 4, 6, 3, 5))  # [P, h, g, j, a, t, c]
    k = gl.convert_layout(gl.reshape(k, (N, D)), a_layout, assert_trivial=True)
    s = mma_v2(k, q, gl.zeros([N, 8], gl.float32, layout=MMA))
    r = gl.arange(0, N, gl.SliceLayout(1, MMA))
    r16 = r % 16
    key = start + r - r16 + 4 * (r16 % 8 // 2) + 2 * (r16 // 8) + r16 % 2
    s = gl.where(gl.expand_dims(key < last, 1), s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    m_safe = gl.where(m_new > float("-inf"), m_new, 0.0)  # a head with nothing allowed yet
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - gl.expand_dims(m_safe, 0))
    l_i = l_i * alpha + gl.sum(p, axis=0)
    # Pᵀ [keys, heads] -> B operand: movmatrix transposes each 8x8 block of the accumulator
    pt = gl.inline_asm_elementwise(_TRANSPOSE, "=r,r", [p.to(gl.float16)], dtype=gl.float16,
                                   is_pure=True, pack=2)
    pt = gl.reshape(gl.permute(gl.reshape(pt, (N // 8, 8, 8)), (0, 2, 1)), (N, 8))
    pt = gl.convert_layout(pt, b_layout, assert_trivial=True)
    v = gl.permute(_widen(v_words), (0, 1, 2, 3, 6, 4, 5))  # [i, h, g, P, a, t, c]
    v = gl.convert_layout(gl.reshape(v, (D, N)), a_layout, assert_trivial=True)
    acc = mma_v2(v, pt, acc * gl.expand_dims(alpha, 0))
    return m_new, l_i, acc


# (pages_stride and num_splits vary from step to step: specializing on them would compile new
# variants inside a run)
@gluon.jit(do_not_specialize=["pages_stride", "num_splits"])
def _fp8_decode(q_ptr, k_ptr, v_ptr, scales_ptr, table_ptr, seq_lens_ptr, cu_ptr, partial_ptr,
                lse_ptr, out_ptr, scale, pages_stride, num_splits, NUM_HEADS: gl.constexpr,
                NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                PAGE_SIZE: gl.constexpr, PAGES: gl.constexpr, DIRECT: gl.constexpr,
                MIN_SPLIT: gl.constexpr, PDL: gl.constexpr):
    """Program (request b, KV head, split): keys [first, last) of b's context. q: [tokens,
    heads, D] (row cu[b]); k_ptr/v_ptr: the FP8 pools viewed as int32 words; scales [2, KV
    heads] (K, V). DIRECT: write the output; else the split's normalized partial [D] per head
    and its natural-log LSE, merged by decode_split.merge_kernel."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                  instr_shape=[16, 8])
    B_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    J: gl.constexpr = HEAD_DIM // 16
    K_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, J], [1, 1, 8, 4, 1], [1, 1, 1, 1, 1],
                                              [4, 3, 2, 1, 0])
    V_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 1], [1, 1, 8, 1, 4], [1, 1, 1, 1, 1],
                                              [4, 3, 2, 1, 0])
    BLOCK: gl.constexpr = 16 * PAGES
    enter(PDL)
    b = gl.program_id(0)
    kv_head = gl.program_id(1)
    split = gl.program_id(2)
    seq_len = gl.load(seq_lens_ptr + b)
    row = gl.load(cu_ptr + b)
    per_split = split_len(seq_len, num_splits, BLOCK, MIN_SPLIT)
    first = split * per_split
    last = gl.minimum(first + per_split, seq_len)
    table = table_ptr + b * pages_stride

    # Qᵀ as the B operand [D (k), 8 (heads)]: index 16 j + 8 a + 2 t + c is byte 2a + c of K's
    # word 16 (j // 4) + 4t + j % 4
    kk = gl.arange(0, HEAD_DIM, gl.SliceLayout(1, B_LAYOUT))
    n = gl.arange(0, 8, gl.SliceLayout(0, B_LAYOUT))
    j = kk // 16
    d = 4 * (16 * (j // 4) + 4 * (kk % 8 // 2) + j % 4) + 2 * (kk % 16 // 8) + kk % 2
    q = gl.load(q_ptr + (row * NUM_HEADS + kv_head * GROUP + gl.expand_dims(n, 0)) * HEAD_DIM
                + gl.expand_dims(d, 1), mask=gl.expand_dims(n < GROUP, 0), other=0.0)
    q = gl.minimum(gl.maximum(q.to(gl.float32), -65504.0), 65504.0).to(gl.float16)
    qk_scale = scale * 1.4426950408889634 * gl.load(scales_ptr + kv_head)
    v_scale = gl.load(scales_ptr + NUM_KV_HEADS + kv_head)

    k_offs, v_offs = _offsets(NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, K_LAYOUT, V_LAYOUT)
    m_i = gl.full([8], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    l_i = gl.zeros([8], gl.float32, layout=gl.SliceLayout(0, MMA))
    acc = gl.zeros([HEAD_DIM, 8], gl.float32, layout=MMA)
    k_words, v_words = _load_block(k_ptr, v_ptr, table, first, last, kv_head, k_offs, v_offs,
                                   K_LAYOUT, V_LAYOUT, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, PAGES)
    for start in range(first, last, BLOCK):
        k_next, v_next = _load_block(k_ptr, v_ptr, table, start + BLOCK, last, kv_head, k_offs,
                                     v_offs, K_LAYOUT, V_LAYOUT, NUM_KV_HEADS, HEAD_DIM,
                                     PAGE_SIZE, PAGES)
        m_i, l_i, acc = _step(k_words, v_words, q, start, last, m_i, l_i, acc, qk_scale, PAGES,
                              MMA)
        k_words = k_next
        v_words = v_next

    has_work = l_i > 0
    out = acc * gl.expand_dims(v_scale / gl.where(has_work, l_i, 1.0), 0)
    dd = gl.expand_dims(gl.arange(0, HEAD_DIM, gl.SliceLayout(1, MMA)), 1)
    col = gl.arange(0, 8, gl.SliceLayout(0, MMA))
    heads = kv_head * GROUP + col
    live = gl.expand_dims(col < GROUP, 0)
    if DIRECT:
        gl.store(out_ptr + gl.expand_dims(row * NUM_HEADS + heads, 0) * HEAD_DIM + dd,
                 out.to(out_ptr.dtype.element_ty), mask=live)
    else:
        out_row = (b * NUM_HEADS + heads) * num_splits + split
        gl.store(partial_ptr + gl.expand_dims(out_row, 0) * HEAD_DIM + dd, out, mask=live)
        lse = gl.where(has_work, (m_i + gl.log2(gl.where(has_work, l_i, 1.0)))
                       / 1.4426950408889634, float("-inf"))
        gl.store(lse_ptr + out_row, lse, mask=col < GROUP)
