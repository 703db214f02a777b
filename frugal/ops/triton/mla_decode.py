"""Paged MLA decode attention, absorbed (as FlashMLA computes it), split over keys.

One program takes a request's next token, up to MAX_BLOCK_H of its heads and one split of its
context: scores q_latent · c + q_rope · k_rope against each cached row [c | k_rope] of the latent
cache, an online softmax, and the weighted sum of the latents c. Splits write (partial output,
log-sum-exp) and `mla_decode` merges them, so a long context at a small batch still fills the
GPU.
The twin is torch_ref.mla_attention (the decode rows of a step).

SPARSE: a program row is a new token of any request (a decode or a prompt token) and its keys
are the positions its DSA selection lists (-1: none) instead of 0..seq_len-1; the twin is
torch_ref.sparse_mla_attention.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from frugal.ops import torch_ref
from frugal.ops.torch_ref.kv_quant import row_scaled, scale_view
from frugal.ops.triton.decode_split import split_len
from frugal.ops.triton.launch import enter, pdl
from frugal.ops.triton.sizes import cdiv, next_power_of_2
from frugal.ops.triton.token_rows import page_slot, token_request

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Heads a program takes: all of them up to 64 (tl.dot needs at least 16), so each cached row is
# read once, 64 keys an iteration. Against 16 heads and 32 keys, measured on the H200 at GLM-5's
# shapes: dense decode 3.3x faster at 16 requests of 128k, 1.5x at one; sparse over 2,048
# positions 1.6x faster at 16 requests (benchmarks/sparse_attention.py --sweep).
MAX_BLOCK_H = 64
BLOCK_N = 64  # keys an iteration takes
NUM_WARPS: int | None = None  # None: 8 for a latent of 256 or more, else 4
# Splits: the launch has up to SPLIT_PROGRAMS programs (about two waves of the H200's 132 SMs dense,
# one sparse), and each program cuts its request's context at run time (as decode_split.split_len
# cuts it), so a CUDA graph captured for the longest context still spreads a short one: a split
# takes about sqrt(SPLIT_SCALE x programs' (request, head block) pairs x keys) keys, whole blocks of
# BLOCK_N and at least min_split (MIN_SPLIT_KEYS). Fewer, longer splits cost a longer serial loop,
# more cost their partial outputs (64 heads x 512 fp32 a split: 128 KiB, as much as 111 cached rows)
# and the merge. On an H100, one layer's decode + merge, 64 heads, splits cut on the host (a cache
# read from L2): one request of 576 keys 19.5 us in 3 splits, 11.8 in 9; of 8,192 keys 26.4 in 32,
# 20.7 in 64, 33.8 in 128; 4 requests of 8,192 keys 41.6 in 32 a request, 56.8 in 66; 16 of 2,048
# 44.6 in 8, 55.4 in 17 (the rule picks 9, 64, 32 and 8)
MIN_SPLIT_KEYS = (64, 64)
SPLIT_PROGRAMS = (264, 132)
SPLIT_SCALE = 2
NUM_STAGES: int | None = 2  # (2 against Triton's default 3: as fast or faster at every shape)


# (the step's page-table width and longest context change from step to step: one variant;
# slb is splits x heads, the splits by that context)
@triton.jit(do_not_specialize=["spt", "num_requests", "num_selected", "min_split", "slb"])
def _mla_decode(q_ptr, cache_ptr, page_table_ptr, seq_lens_ptr, out_ptr, lse_ptr, scale,
                num_heads, min_split, sqt, sqh, spt, srow, sob, sos, soh, slb, sls,
                sel_ptr, cu_ptr, num_requests, num_selected, ssel, kv_scale_ptr, row_scale_ptr,
                PAGE_SIZE: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr,
                SPARSE: tl.constexpr, FP8: tl.constexpr, F32_DOT: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_ROW: tl.constexpr,
                SPLIT_SCALE: tl.constexpr, PDL: tl.constexpr):
    """FP8: a static cache, its one scale at kv_scale_ptr. SCALE_ROW > 0: 8-bit rows with their
    own scale, slot s's at row_scale_ptr + s * SCALE_ROW (on its scores and its weight). A
    split past its request's context stores only its log-sum-exp (-inf)."""
    enter(PDL)
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = heads < num_heads
    if SPARSE:
        seq_len = num_selected
        table_row = token_request(cu_ptr, num_requests, b)
    else:
        seq_len = tl.load(seq_lens_ptr + b)
        table_row = b
    # (at least min_split and the spread, in whole blocks: decode_split's cut of the context)
    pairs = tl.num_programs(0) * tl.num_programs(1)
    spread = tl.sqrt(seq_len.to(tl.float32) * (SPLIT_SCALE * pairs)).to(tl.int32)
    least = tl.cdiv(tl.maximum(spread, min_split), BLOCK_N) * BLOCK_N
    per_split = split_len(seq_len, tl.num_programs(2), BLOCK_N, least)
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    if start >= end:  # (no key here: the merge reads no output of this split)
        tl.store(lse_ptr + b * slb + split * sls + heads, float("-inf"), mask=h_ok)
        return
    lat = tl.arange(0, LAT)
    rope = tl.arange(0, ROPE)
    q_row = q_ptr + b * sqt + heads[:, None] * sqh
    q_lat = tl.load(q_row + lat[None, :], mask=h_ok[:, None], other=0.0)
    q_rope = tl.load(q_row + LAT + rope[None, :], mask=h_ok[:, None], other=0.0)
    if F32_DOT:
        q_lat, q_rope = q_lat.to(tl.float32), q_rope.to(tl.float32)
    qk_scale = scale
    if FP8:
        kv_scale = tl.load(kv_scale_ptr)
        qk_scale = scale * kv_scale
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, LAT), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < end
        if SPARSE:
            pos = tl.load(sel_ptr + b * ssel + pos, mask=ok, other=-1)
            ok = pos >= 0
        page = tl.load(page_table_ptr + table_row * spt + pos // PAGE_SIZE, mask=ok, other=0)
        slot = page_slot(page.to(tl.int64), pos, PAGE_SIZE)
        row = cache_ptr + slot[:, None] * srow
        c = tl.load(row + lat[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_N, LAT]
        k_rope = tl.load(row + LAT + rope[None, :], mask=ok[:, None], other=0.0)
        if FP8 or SCALE_ROW > 0:  # (scales are applied to the scores and the weights / output)
            c, k_rope = c.to(q_lat.dtype), k_rope.to(q_lat.dtype)
        if F32_DOT:
            c, k_rope = c.to(tl.float32), k_rope.to(tl.float32)
            s = (tl.dot(q_lat, tl.trans(c), input_precision="ieee")
                 + tl.dot(q_rope, tl.trans(k_rope), input_precision="ieee"))
        else:
            s = tl.dot(q_lat, tl.trans(c)) + tl.dot(q_rope, tl.trans(k_rope))
        s = s * qk_scale
        if SCALE_ROW > 0:
            own = tl.load(row_scale_ptr + slot * SCALE_ROW, mask=ok, other=0.0)
            s = s * own[None, :]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, axis=1)
        if SCALE_ROW > 0:
            p = p * own[None, :]
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        elif SCALE_ROW > 0:  # (bf16: p times a small scale would be an fp16 subnormal)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), c.to(tl.bfloat16))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m = m_new
    safe = tl.where(total > 0, total, 1.0)
    out = acc / safe[:, None]
    if FP8:
        out = out * kv_scale
    tl.store(out_ptr + b * sob + split * sos + heads[:, None] * soh + lat[None, :], out,
             mask=h_ok[:, None])
    lse = tl.where(total > 0, m + tl.log(safe), float("-inf"))
    tl.store(lse_ptr + b * slb + split * sls + heads, lse, mask=h_ok)


@triton.jit(do_not_specialize=["splits", "spb", "slb"])  # (splits: 1 at short contexts)
def _merge(part_ptr, lse_ptr, out_ptr, splits, spb, sps, sph, slb, sls, sob, soh,
           CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """out[b, head, d-block] = Σ_split partial · exp(lse - top) / Σ_split exp(lse - top), in
    out's dtype (0 where no split saw a key): program (b, head, d-block), CHUNK splits a step.
    A first pass over the log-sum-exps finds top and the last split that saw keys (a short
    context's are the first ones); the second reads the partials of those, where the weight is
    not 0 (a split that stored no output has -inf)."""
    enter(PDL)
    b = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    lse_row = lse_ptr + b * slb + head
    top = tl.full((), float("-inf"), tl.float32)
    live = tl.full((), 0, tl.int32)
    for c0 in range(0, splits, CHUNK):
        s = c0 + tl.arange(0, CHUNK)
        lse = tl.load(lse_row + s * sls, mask=s < splits, other=float("-inf"))
        top = tl.maximum(top, tl.max(lse, axis=0))
        live = tl.maximum(live, tl.max(tl.where(lse > float("-inf"), s + 1, 0), axis=0))
    top = tl.where(top > float("-inf"), top, 0.0)
    total = tl.zeros((), dtype=tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for c0 in range(0, live, CHUNK):
        s = c0 + tl.arange(0, CHUNK)
        w = tl.exp(tl.load(lse_row + s * sls, mask=s < live, other=float("-inf")) - top)
        total += tl.sum(w, axis=0)
        part = tl.load(part_ptr + b * spb + s[:, None] * sps + head * sph + d[None, :],
                       mask=(w > 0)[:, None], other=0.0)
        acc += tl.sum(part * w[:, None], axis=0)
    out = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out_ptr + b * sob + head * soh + d, out.to(out_ptr.dtype.element_ty))


def merge(part: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The splits' partial outputs part [B, splits, heads, LAT] fp32 and their log-sum-exps lse
    [B, splits, heads] (-inf: the split saw no key, and its part is not read) into
    [B, heads, LAT] in dtype, one launch whatever the splits (torch: softmax of lse over the
    splits, weighted sum of part, 0 where every lse is -inf)."""
    batch, splits, heads, lat = part.shape
    out = torch.empty(batch, heads, lat, dtype=dtype, device=part.device)
    block_d = min(128, lat)
    launch_pdl = pdl(part.device)
    _merge[(batch, heads, lat // block_d)](part, lse, out, splits, part.stride(0),
                                           part.stride(1), part.stride(2), lse.stride(0),
                                           lse.stride(1), out.stride(0), out.stride(1),
                                           CHUNK=16, BLOCK_D=block_d, PDL=launch_pdl,
                                           num_warps=4, launch_pdl=launch_pdl > 0)
    return out


def supported(kv_lora_rank: int, rope_dim: int) -> bool:
    """The kernel's latent and rotary widths: powers of two of at least 16 (tl.dot's)."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (kv_lora_rank, rope_dim))


def mla_decode(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, max_seq_len: int,
               kv_lora_rank: int, selection: torch.Tensor | None = None,
               cu_seqlens_q: torch.Tensor | None = None,
               kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, num_heads, kv_lora_rank + rope] absorbed queries, one token of each request;
    cache: [num_pages, page_size, 1, kv_lora_rank + rope] (a column view of wider rows is
    fine); page_table [B, max_pages] int32, seq_lens [B] int32 (the token's own row stored).
    Returns [B, num_heads, kv_lora_rank] in q's dtype (zeros for seq_len 0).

    selection ([B, k] int32, see torch_ref.dsa) with cu_seqlens_q ([requests + 1] int32, the
    step's query offsets: row t's page_table row is the request holding token t): the B rows are
    new tokens of any requests attending to their selected positions;
    seq_lens and max_seq_len are then unused. A static FP8 cache comes with kv_scales ([2, 1],
    torch_ref.mla); 8-bit rows without them carry their own scale (cache [.., width + 4])."""
    batch, num_heads, width = q.shape
    own = row_scaled(cache, width, kv_scales)
    row_scales = scale_view(cache, width) if own else seq_lens  # (any tensor: not read)
    page_size = cache.shape[1]
    block_h = min(MAX_BLOCK_H, max(16, next_power_of_2(num_heads)))
    if selection is not None:
        max_seq_len = selection.shape[1]
    # splits: up to SPLIT_PROGRAMS programs; each cuts its context at run time (_mla_decode)
    sparse = selection is not None
    pairs = batch * cdiv(num_heads, block_h)
    min_split = MIN_SPLIT_KEYS[sparse]
    splits = max(1, min(cdiv(max(max_seq_len, 1), min_split),
                        cdiv(SPLIT_PROGRAMS[sparse], pairs)))
    out = torch.empty(batch, splits, num_heads, kv_lora_rank, dtype=torch.float32,
                      device=q.device)
    lse = torch.empty(batch, splits, num_heads, dtype=torch.float32, device=q.device)
    grid = (batch, cdiv(num_heads, block_h), splits)
    launch_pdl = pdl(q.device)
    _mla_decode[grid](q, cache, page_table, seq_lens, out, lse, scale, num_heads, min_split,
                      q.stride(0), q.stride(1), page_table.stride(0), cache.stride(1),
                      out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
                      selection if sparse else seq_lens, cu_seqlens_q if sparse else seq_lens,
                      cu_seqlens_q.shape[0] - 1 if sparse else 0, max_seq_len,
                      selection.stride(0) if sparse else 0,
                      seq_lens if kv_scales is None else kv_scales, row_scales, PAGE_SIZE=page_size,
                      LAT=kv_lora_rank, ROPE=width - kv_lora_rank, SPARSE=sparse,
                      FP8=cache.element_size() == 1 and not own,
                      SCALE_ROW=row_scales.stride(1) if own else 0,
                      F32_DOT=_INTERPRET or q.dtype == torch.float32, BLOCK_H=block_h,
                      BLOCK_N=BLOCK_N, SPLIT_SCALE=SPLIT_SCALE, PDL=launch_pdl,
                      launch_pdl=launch_pdl > 0,
                      num_warps=NUM_WARPS or (8 if kv_lora_rank >= 256 else 4),
                      **({} if NUM_STAGES is None else {"num_stages": NUM_STAGES}))
    return merge(out, lse, q.dtype)


def mla_attention(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                  max_query_len: int, max_seq_len: int, kv_lora_rank: int,
                  num_decodes: int = 0, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """torch_ref.mla_attention's twin: the step's leading decodes through mla_decode, the
    requests with prompt tokens through the PyTorch op (no Triton prefill kernel yet)."""
    if num_decodes == 0 or not supported(kv_lora_rank, q.shape[-1] - kv_lora_rank):
        return torch_ref.mla_attention(q, cache, page_table, cu_seqlens_q, seq_lens, scale,
                                       max_query_len, max_seq_len, kv_lora_rank, num_decodes,
                                       kv_scales)
    if num_decodes == seq_lens.shape[0] == q.shape[0]:  # (a decode step: its rows as they are)
        return mla_decode(q, cache, page_table, seq_lens, scale, max_seq_len, kv_lora_rank,
                          kv_scales=kv_scales)
    out = torch.empty(*q.shape[:2], kv_lora_rank, dtype=q.dtype, device=q.device)
    out[:num_decodes] = mla_decode(q[:num_decodes], cache, page_table[:num_decodes],
                                   seq_lens[:num_decodes], scale, max_seq_len, kv_lora_rank,
                                   kv_scales=kv_scales)
    if num_decodes < seq_lens.shape[0]:
        cu = cu_seqlens_q[num_decodes:] - num_decodes
        out[num_decodes:] = torch_ref.mla_attention(
            q[num_decodes:], cache, page_table[num_decodes:], cu, seq_lens[num_decodes:], scale,
            max_query_len, max_seq_len, kv_lora_rank, kv_scales=kv_scales)
    return out
