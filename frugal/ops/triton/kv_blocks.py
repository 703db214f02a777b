"""Building blocks of the Triton paged-attention kernels (frugal.ops.triton.attention): a block
of K/V rows gathered through a page table (bf16/fp32, or 8-bit widened in registers, with the
rows' own scales where they carry them) and one step of online softmax over it."""

import triton
import triton.language as tl

from frugal.ops.triton.token_rows import page_slot


@triton.jit
def dot_dtype(q, DOT_F32: tl.constexpr, FP8: tl.constexpr):
    """q in the dtype the products run in (K/V tiles are cast to it): fp32 in the interpreter;
    for an FP8 cache fp16, as FP8 widens to fp16 exactly in one instruction per two values
    (to bf16 it takes several; measured 1.1x faster at B=64, L=4096), q saturated to its range."""
    if DOT_F32:
        q = q.to(tl.float32)
    elif FP8:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def softmax_start(q, scale, scales_ptr, kv_head, ROWS: tl.constexpr, DIM_PAD: tl.constexpr,
                  NUM_KV_HEADS: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr,
                  ROW_SCALED: tl.constexpr):
    """The start of online softmax over a KV head's keys for ROWS query rows q: (q in its dot
    dtype, the log2 score scale, V's scale, the running max, sum and output). FP8 (static
    scales, scales_ptr [2, NUM_KV_HEADS]): the head's K scale joins the score scale and its V
    scale is returned for the output; else V's scale is 1."""
    q = dot_dtype(q, DOT_F32, FP8 or ROW_SCALED)
    qk_scale = scale * 1.4426950408889634
    v_scale = 1.0
    if FP8:
        qk_scale = qk_scale * tl.load(scales_ptr + kv_head)
        v_scale = tl.load(scales_ptr + NUM_KV_HEADS + kv_head)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM_PAD], tl.float32)
    return q, qk_scale, v_scale, m_i, l_i, acc


@triton.jit
def load_kv(k_cache_ptr, v_cache_ptr, table_ptr, pos, n_mask, end, d, d_mask, kv_head, q,
            NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
            DOT_F32: tl.constexpr, FP8: tl.constexpr, MASKED: tl.constexpr = True,
            K_ROW: tl.constexpr = 0, V_ROW: tl.constexpr = 0, V_BF16: tl.constexpr = False):
    """K and V rows [BLOCK_N, DIM_PAD] of context positions `pos` (a block starting at a
    multiple of PAGE_SIZE), gathered through the page table of one request; masked rows (pos >=
    end) read as 0. Cast to q's dtype for the dot. MASKED False: every pos < end and
    HEAD_DIM == DIM_PAD, so the loads carry no mask (n_mask is not read). K_ROW / V_ROW:
    elements from one (slot, head) row to the next (0: HEAD_DIM, a dense cache; more when rows
    carry a scale, or K and V share one row: ops.torch_ref.kv_quant). V_BF16: V in bf16 for
    the dot whatever q's dtype (rows with their own scale: p times a small scale would be an
    fp16 subnormal; 8-bit values are exact in bf16).

    FP8 (static scales): V is key-minor, so a page's keys load as runs of PAGE_SIZE bytes; the
    mask is per page (rows past `end` in the last page are read: pool memory, never NaN, and
    their weights are 0). Returns (k, v, k_rows, v_rows): the last two, the (slot, head) row
    index of each key ([BLOCK_N], for loading row scales).
    """
    other = 0.0 if MASKED else None
    page = tl.load(table_ptr + pos // PAGE_SIZE, mask=n_mask if MASKED else None,
                   other=0 if MASKED else None).to(tl.int64)
    slot = page_slot(page, pos, PAGE_SIZE)
    rows_kv = slot * NUM_KV_HEADS + kv_head
    KR: tl.constexpr = K_ROW if K_ROW > 0 else HEAD_DIM
    VR: tl.constexpr = V_ROW if V_ROW > 0 else HEAD_DIM
    offs = rows_kv[:, None] * KR + d[None, :]
    mask = n_mask[:, None] & d_mask[None, :] if MASKED else None
    k = tl.load(k_cache_ptr + offs, mask=mask, other=other)
    if FP8:
        # runs of keys contiguous in memory: a page, or the whole block if pages are longer
        RUN: tl.constexpr = PAGE_SIZE if PAGE_SIZE < pos.shape[0] else pos.shape[0]
        rows = (page * NUM_KV_HEADS + kv_head) * HEAD_DIM * PAGE_SIZE + pos % PAGE_SIZE
        rows = tl.max_contiguous(tl.multiple_of(rows, RUN), RUN)
        in_page = (pos // PAGE_SIZE * PAGE_SIZE) < end
        v = tl.load(v_cache_ptr + rows[:, None] + (d * PAGE_SIZE)[None, :],
                    mask=in_page[:, None] & d_mask[None, :] if MASKED else None, other=other)
    else:
        v = tl.load(v_cache_ptr + rows_kv[:, None] * VR + d[None, :], mask=mask, other=other)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        k = k.to(q.dtype)
        v = v.to(tl.bfloat16) if V_BF16 else v.to(q.dtype)
    return k, v, rows_kv


@triton.jit
def row_scales(scale_ptr, rows_kv, n_mask, SCALE_ROW: tl.constexpr, MASKED: tl.constexpr = True):
    """The fp32 scales of K or V rows rows_kv ([BLOCK_N]; scale_ptr: a float32 view of the
    cache whose row r's scale is at r * SCALE_ROW); masked rows read 0."""
    return tl.load(scale_ptr + rows_kv * SCALE_ROW, mask=n_mask if MASKED else None,
                   other=0.0 if MASKED else None)


@triton.jit
def softmax_step(q, k, v, allowed, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr,
                 MASKED: tl.constexpr = True, k_scale=None, v_scale=None):
    """One block of online softmax (log2 units): scores q·kᵀ where allowed (everywhere if not
    MASKED), then rescale the running max m_i, sum l_i and output acc. Returns the updated
    (m_i, l_i, acc). k_scale, v_scale ([BLOCK_N] or None): each key's and value's own scale
    (rows that carry one), applied to its score column and to its weight in p·v."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if k_scale is not None:
        s = s * k_scale[None, :]
    if MASKED:
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row with nothing allowed yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if v_scale is not None:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def attend_fresh(k_ptr, v_ptr, k_stride, v_stride, first_row, first, end, q_pos, kv_head, d,
                 d_mask, q, m_i, l_i, acc, qk_scale, HEAD_DIM: tl.constexpr,
                 BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax (softmax_step) over the keys at positions first .. end - 1 taken from the
    step's own K and V rows ([tokens, NUM_KV_HEADS, HEAD_DIM] in q's dtype, k_stride / v_stride
    elements from one token to the next, heads HEAD_DIM apart), position `first` being row
    first_row; causal: a query row at q_pos sees keys at positions <= q_pos. No scales: these
    keys and values are the activations themselves. Returns the updated (m_i, l_i, acc)."""
    n = tl.arange(0, BLOCK_N)
    for kv_start in range(first, end, BLOCK_N):
        pos = kv_start + n
        n_mask = pos < end
        rows = (first_row + pos - first).to(tl.int64)
        mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + rows[:, None] * k_stride + kv_head * HEAD_DIM + d[None, :],
                    mask=mask, other=0.0)
        v = tl.load(v_ptr + rows[:, None] * v_stride + kv_head * HEAD_DIM + d[None, :],
                    mask=mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        allowed = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        m_i, l_i, acc = softmax_step(q, k, v, allowed, m_i, l_i, acc, qk_scale, PRECISION)
    return m_i, l_i, acc
