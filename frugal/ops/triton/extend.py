"""The Triton prompt (prefill / extend) kernel of paged attention (ops.triton.attention launches
it): each program attends a block of one request's new tokens, for every query head of one KV
head, over the request's context, causally masked; with fresh K/V, the step's own tokens come
from the activations and only the context before them from the cache."""

import triton
import triton.language as tl

from frugal.ops.triton.kv_blocks import (
    attend_fresh,
    dot_dtype,
    load_kv,
    row_scales,
    softmax_start,
    softmax_step,
)


@triton.jit
def work_item(cu_ptr, first, batch, item, TOKENS: tl.constexpr):
    """(request, block of TOKENS of its new tokens) of work item `item`, the items laid out
    request after request from `first` on (a request of n new tokens: cdiv(n, TOKENS) items);
    block -1 past the last item; and the number of items. Reads the offsets 16 requests at a
    time (no constant that grows with the batch: no kernel compiled mid-serving for a bigger
    one)."""
    found, block, carry = batch, -1, 0
    for c0 in range(first, batch, 16):
        rs = tl.arange(0, 16)
        ok = c0 + rs < batch
        lo = tl.load(cu_ptr + c0 + rs, mask=ok, other=0)
        hi = tl.load(cu_ptr + c0 + rs + 1, mask=ok, other=0)
        blocks = tl.where(ok, (hi - lo + TOKENS - 1) // TOKENS, 0)
        ends = carry + tl.cumsum(blocks, axis=0)
        k = tl.sum((ends <= item).to(tl.int32), axis=0)
        total = tl.sum(blocks, axis=0)
        inside = (item >= carry) & (item < carry + total)
        before = tl.sum(tl.where(rs == k, ends - blocks, 0), axis=0)
        found = tl.where(inside, c0 + k, found)
        block = tl.where(inside, item - before, block)
        carry += total
    return found, block, carry


@triton.jit(do_not_specialize=["pages_stride", "first", "batch", "num_rows"])
def extend_kernel(q_ptr, k_cache_ptr, v_cache_ptr, scales_ptr, k_scale_ptr, v_scale_ptr,
                   page_table_ptr, seq_lens_ptr, cu_ptr, out_ptr, fresh_k_ptr, fresh_v_ptr,
                   fresh_k_stride, fresh_v_stride, scale, pages_stride, first,
                   batch, num_rows, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
                   FP8: tl.constexpr, K_ROW: tl.constexpr, V_ROW: tl.constexpr,
                   K_SROW: tl.constexpr, V_SROW: tl.constexpr, FRESH: tl.constexpr):
    """One program: BLOCK_M // GROUP_PAD new tokens of one request, for every query head of one
    KV head (row r: token r // GROUP_PAD, head r % GROUP_PAD of the group), so each K/V block is
    loaded (FP8: and widened) once for the group. Programs are work items of requests `first` ..
    batch - 1 (work_item): a grid of cdiv(tokens, TOKENS) + requests items covers any step, so
    a padded step (worker.prompt_graphs) launches no program per (request, longest prompt's
    block). FP8, K_ROW .. V_SROW: as in attention._decode_kernel. FRESH: a request of several
    new tokens reads their keys and values from fresh_k_ptr / fresh_v_ptr (kv_blocks.attend_fresh:
    rows of the step's tokens, as q's) and only the keys before them from the cache.
    The items past the last zero the output's rows past the last request's tokens up to
    num_rows (a padded step's: the grid has cdiv(padding, TOKENS) such items at least)."""
    kv_head = tl.program_id(1)
    TOKENS: tl.constexpr = BLOCK_M // GROUP_PAD
    b, block, items = work_item(cu_ptr, first, batch, tl.program_id(0), TOKENS)
    if block < 0:
        r = tl.arange(0, BLOCK_M)
        i = tl.load(cu_ptr + batch) + (tl.program_id(0) - items) * TOKENS + r // GROUP_PAD
        g = r % GROUP_PAD
        d = tl.arange(0, DIM_PAD)
        ok = (i < num_rows) & (g < GROUP)
        offs = (i.to(tl.int64) * NUM_HEADS + kv_head * GROUP + g)[:, None] * HEAD_DIM + d[None, :]
        tl.store(out_ptr + offs, tl.zeros((BLOCK_M, DIM_PAD), out_ptr.dtype.element_ty),
                 mask=ok[:, None] & (d < HEAD_DIM)[None, :])
    b = tl.minimum(b, batch - 1)  # (an item past the last, block -1: reads a real row, exits)
    start = tl.load(cu_ptr + b)
    num_new = tl.load(cu_ptr + b + 1) - start
    if (block >= 0) & (block * TOKENS < num_new):
        seq_len = tl.load(seq_lens_ptr + b)
        r = tl.arange(0, BLOCK_M)
        i = block * TOKENS + r // GROUP_PAD  # the row's new token
        g = r % GROUP_PAD
        heads = kv_head * GROUP + g
        d = tl.arange(0, DIM_PAD)
        row_mask = (i < num_new) & (g < GROUP)
        d_mask = d < HEAD_DIM
        q_pos = seq_len - num_new + i  # absolute position of each new token
        offs = ((start + i) * NUM_HEADS + heads)[:, None] * HEAD_DIM + d[None, :]
        q = tl.load(q_ptr + offs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        q, qk_scale, v_scale, m_i, l_i, acc = softmax_start(q, scale, scales_ptr, kv_head, BLOCK_M,
                                                            DIM_PAD, NUM_KV_HEADS, DOT_F32, FP8,
                                                            K_SROW > 0)
        # keys up to the last new token of this block (causal); the blocks every row sees
        # whole (before the first row's position) run without masks
        end = tl.minimum(seq_len, seq_len - num_new + (block + 1) * TOKENS)
        seen = (seq_len - num_new + block * TOKENS + 1) // BLOCK_N * BLOCK_N
        cached = end  # keys read from the cache: [0, cached)
        if FRESH:  # (a decode's one token: from the cache, as every later step reads it)
            cached = tl.minimum(end, seq_len - tl.where(num_new > 1, num_new, 0))
            seen = tl.minimum(seen, cached // BLOCK_N * BLOCK_N)
        if HEAD_DIM != DIM_PAD:
            seen = 0
        table = page_table_ptr + b * pages_stride
        n = tl.arange(0, BLOCK_N)
        for kv_start in range(0, seen, BLOCK_N):
            pos = tl.multiple_of(kv_start, BLOCK_N) + n
            k, v, rows = load_kv(k_cache_ptr, v_cache_ptr, table, pos, None, cached, d, d_mask,
                                 kv_head, q, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, DOT_F32, FP8,
                                 False, K_ROW, V_ROW, V_SROW > 0)
            ks = row_scales(k_scale_ptr, rows, None, K_SROW, False) if K_SROW > 0 else None
            vs = row_scales(v_scale_ptr, rows, None, V_SROW, False) if V_SROW > 0 else None
            m_i, l_i, acc = softmax_step(q, k, v, None, m_i, l_i, acc, qk_scale, PRECISION,
                                         False, ks, vs)
        for kv_start in range(seen, cached, BLOCK_N):
            pos = tl.multiple_of(kv_start, BLOCK_N) + n
            n_mask = pos < cached
            k, v, rows = load_kv(k_cache_ptr, v_cache_ptr, table, pos, n_mask, cached, d,
                                 d_mask, kv_head, q, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, DOT_F32,
                                 FP8, True, K_ROW, V_ROW, V_SROW > 0)
            ks = row_scales(k_scale_ptr, rows, n_mask, K_SROW) if K_SROW > 0 else None
            vs = row_scales(v_scale_ptr, rows, n_mask, V_SROW) if V_SROW > 0 else None
            allowed = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
            m_i, l_i, acc = softmax_step(q, k, v, allowed, m_i, l_i, acc, qk_scale, PRECISION,
                                         True, ks, vs)
        if FRESH:
            # the cache's part of acc in true units (FP8: its V scale), then the fresh keys in
            # the activation dtype, with no scales
            acc = acc * v_scale
            v_scale = 1.0
            q = tl.load(q_ptr + offs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
            q = dot_dtype(q, DOT_F32, False)
            m_i, l_i, acc = attend_fresh(fresh_k_ptr, fresh_v_ptr, fresh_k_stride,
                                         fresh_v_stride, start + cached - (seq_len - num_new),
                                         cached, end, q_pos, kv_head, d, d_mask, q, m_i, l_i,
                                         acc, scale * 1.4426950408889634, HEAD_DIM, BLOCK_N,
                                         DOT_F32, PRECISION)
        out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & d_mask[None, :])
