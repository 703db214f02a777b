"""Paged attention in Triton. Same signatures as frugal.ops.torch_ref.attention.

Decode (one new token per request) is split-K and GQA-aware: a program owns one request, one KV
head and one slice of the context, reads each K/V row of that slice once for every query head of
the group, and leaves a partial result with its log-sum-exp; a second kernel merges the slices.
Prefill/extend (several new tokens, ops.triton.extend) runs one program per (request, KV head,
block of new tokens) over the cached context, causally masked; its rows are the block's tokens
times the group's query heads, so K/V are read once per group, as in decode.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from frugal.ops.torch_ref.kv_quant import row_scaled, scale_view
from frugal.ops.triton import fp8_decode
from frugal.ops.triton.decode_split import merge_kernel, split_len
from frugal.ops.triton.extend import extend_kernel
from frugal.ops.triton.kv_blocks import load_kv, row_scales, softmax_start, softmax_step
from frugal.ops.triton.kv_store import heads_packed
from frugal.ops.triton.launch import enter, pdl
from frugal.ops.triton.sizes import cdiv, next_power_of_2

# The CPU interpreter's bf16 tl.dot is wrong: compute the products in fp32 there.
_DOT_F32 = os.environ.get("TRITON_INTERPRET") == "1"
# Split the context only when (request, KV head) programs are fewer than a wave of the H200's
# 132 SMs; then aim for eight waves (B=1 L=32k: 3.4 TB/s vs 3.0 at two waves; splitting a batch
# that already fills the GPU only adds the merge: Qwen3-30B-A3B's 64 requests x 4 KV heads at
# 544 keys, 25.2 us unsplit against 34.8 in 5 splits and their merge on the H200).
_SPLIT_BELOW = 128
_SPLIT_TARGET = 1056
# A split covers at least this many keys (one block: at batch 1 many short splits beat few
# long ones). The Triton decode kernel's cover this many more for each 32 programs past the
# first 32 (min_split_keys: 16 requests x 4 KV heads at 544 keys ran in 13.8 us as 5 splits
# of 128 keys, 16.3 us as 9 of 64, on the H200); fp8_decode's keep this minimum. The merge
# reads only the splits that saw keys, so the many splits of a CUDA graph captured for the
# longest context cost a short one nothing.
_MIN_SPLIT = 64
# At most this many slices. The merge kernel is compiled for this many whatever the count (a
# count met first in an eager step, a batch mixing decodes with prompt chunks, would otherwise
# compile a kernel inside it); slices that saw no keys are not read.
_MAX_SPLITS = 64
_DECODE_LAUNCH = {"num_warps": 4, "num_stages": 3}  # Triton's defaults, measured in benchmarks/
# 16-bit decodes that run unsplit (_unsplit_fits): 128 keys a block, 8 warps (H200,
# Qwen3-30B-A3B's heads: 64 requests at 2,048 keys 67.7 us against 73.5 with the split
# launch's, 32 at 544 18.3 against 19.7)
_UNSPLIT_LAUNCH = {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
_FP8_GLUON = True  # FP8 decodes run fp8_decode's kernel where it fits (False: the Triton one)


@triton.jit(do_not_specialize=["pages_stride", "num_splits", "min_split"])
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, scales_ptr, k_scale_ptr, v_scale_ptr,
                   page_table_ptr, seq_lens_ptr, cu_ptr, partial_ptr, lse_ptr, out_ptr, scale,
                   pages_stride, num_splits, min_split, NUM_HEADS: tl.constexpr,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
                   DIRECT: tl.constexpr, FP8: tl.constexpr,
                   K_ROW: tl.constexpr, V_ROW: tl.constexpr, K_SROW: tl.constexpr,
                   V_SROW: tl.constexpr, PDL: tl.constexpr):
    """DIRECT (one split): write the normalized output itself, no partials to merge. The
    context is cut into num_splits slices of whole blocks, min_split keys at least (split_len).
    FP8 (static scales): K/V are read as FP8 and widened in registers; the head's K scale joins
    the softmax scale and its V scale multiplies the output (scales_ptr: [2, NUM_KV_HEADS]).
    K_ROW, V_ROW: see kv_blocks.load_kv; K_SROW / V_SROW > 0: K / V rows carry their own
    scales (ops.torch_ref.kv_quant), row r's at k_scale_ptr / v_scale_ptr + r * K_SROW / V_SROW.
    """
    enter(PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    row = tl.load(cu_ptr + b)  # the request's (single) new token
    # this split's slice of the context, in whole blocks of BLOCK_N tokens
    per_split = split_len(seq_len, num_splits, BLOCK_N, min_split)
    first = split * per_split
    last = tl.minimum(first + per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (row * NUM_HEADS + heads)[:, None] * HEAD_DIM + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q, qk_scale, v_scale, m_i, l_i, acc = softmax_start(q, scale, scales_ptr, kv_head, GROUP_PAD,
                                                        DIM_PAD, NUM_KV_HEADS, DOT_F32, FP8,
                                                        K_SROW > 0)
    n = tl.arange(0, BLOCK_N)
    for kv_start in range(first, last, BLOCK_N):  # every block holds >= 1 valid token
        pos = tl.multiple_of(kv_start, BLOCK_N) + n
        n_mask = pos < last
        k, v, rows = load_kv(k_cache_ptr, v_cache_ptr, page_table_ptr + b * pages_stride, pos,
                             n_mask, last, d, d_mask, kv_head, q, NUM_KV_HEADS, HEAD_DIM,
                             PAGE_SIZE, DOT_F32, FP8, True, K_ROW, V_ROW, V_SROW > 0)
        ks = row_scales(k_scale_ptr, rows, n_mask, K_SROW) if K_SROW > 0 else None
        vs = row_scales(v_scale_ptr, rows, n_mask, V_SROW) if V_SROW > 0 else None
        m_i, l_i, acc = softmax_step(q, k, v, n_mask[None, :], m_i, l_i, acc, qk_scale,
                                     PRECISION, True, ks, vs)
    has_work = l_i > 0
    normed = acc * (v_scale / tl.where(has_work, l_i, 1.0))[:, None]
    if DIRECT:
        tl.store(out_ptr + (row * NUM_HEADS + heads)[:, None] * HEAD_DIM + d[None, :],
                 normed.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
        return
    out_row = (b * NUM_HEADS + heads) * num_splits + split
    tl.store(partial_ptr + out_row[:, None] * HEAD_DIM + d[None, :], normed,
             mask=g_mask[:, None] & d_mask[None, :])
    # natural-log LSE of the split (-inf when it saw no token)
    lse = tl.where(has_work, (m_i + tl.log2(tl.where(has_work, l_i, 1.0))) / 1.4426950408889634,
                   float("-inf"))
    tl.store(lse_ptr + out_row, lse, mask=g_mask)


# Keys per inner step of the decode kernel: 64 of bf16 (32 KB of K and V), and of FP8 the same
# bytes, 128 keys. Any page size works: tokens are gathered one by one.
_FP8_BLOCK_N = 128


def _block_n(fp8: bool) -> int:
    return _FP8_BLOCK_N if fp8 else 64


# Rows (new tokens x query heads of a group) per extend program and its launch, by how many rows
# the longest request brings: the best of `benchmarks/extend_attention.py --sweep` on the H200.
# bf16: 64 rows, K/V blocks staged through shared memory two deep. FP8: 128 rows, each block's
# widening then serves twice the rows, and loads straight into registers (no staging: it would
# add a shared-memory round trip to the one the widened block makes for the tensor cores);
# 1.16-1.29x faster than the bf16 launch on prompt chunks.
_EXTEND_LAUNCH = {64: {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
                  16: {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}}
_FP8_EXTEND_LAUNCH = {128: {"BLOCK_N": 64, "num_warps": 4, "num_stages": 1},
                      **_EXTEND_LAUNCH}


def _extend_launch(rows: int, group_pad: int, fp8: bool) -> tuple[int, dict]:
    """(BLOCK_M, launch options) for a batch whose longest request has `rows` query rows: the
    largest block it fills, and at least one whole group."""
    table = _FP8_EXTEND_LAUNCH if fp8 else _EXTEND_LAUNCH
    block_m = next((m for m in sorted(table, reverse=True) if rows >= m), 16)
    block_m = max(block_m, group_pad)
    return block_m, table.get(block_m, table[16])


def num_decode_splits(num_requests: int, num_kv_heads: int, max_seq_len: int,
                      fp8: bool = False) -> int:
    """Context slices per (request, KV head) so a decode step fills the GPU: few long requests
    get many slices, a big batch one. Depends on host values only (CUDA-graph friendly)."""
    programs = max(num_requests * num_kv_heads, 1)
    wanted = 1 if programs >= _SPLIT_BELOW else cdiv(_SPLIT_TARGET, programs)
    return max(1, min(wanted, cdiv(max_seq_len, _block_n(fp8)), _MAX_SPLITS))


def _unsplit_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  consts: dict) -> bool:
    """Whether an unsplit decode takes _UNSPLIT_LAUNCH: 16-bit queries over a cache of their
    dtype (what it was measured on), heads of up to 128 and groups of up to 16 (its three
    stages of 128 keys fit shared memory: 74 KB at d 128; fp32 or groups of 128 would not)."""
    return (q.element_size() == 2 and k_cache.dtype == v_cache.dtype == q.dtype
            and consts["DIM_PAD"] <= 128 and consts["GROUP"] <= 16)


def min_split_keys(num_requests: int, num_kv_heads: int) -> int:
    """Keys a context slice covers at least: _MIN_SPLIT, and _MIN_SPLIT more for each 32
    (request, KV head) programs past the first 32 (the slices of a short context are then
    fewer: the kernels cut each context at run time, split_len)."""
    return _MIN_SPLIT * max(1, cdiv(num_requests * num_kv_heads, 32))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, max_query_len: int, max_seq_len: int,
                    kv_scales: torch.Tensor | None = None, num_decodes: int = 0,
                    fresh: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """See torch_ref.paged_attention. max_query_len / max_seq_len: host-side upper bounds of the
    new tokens and the context length of any request (they size the launch grid). The first
    num_decodes requests (all of them when max_query_len is 1) run the decode kernel, the rest
    the extend kernel; fresh K/V are read by the extend kernel only (for its requests of
    several new tokens), as device tensors (nothing read on the host: capture-safe)."""
    num_heads, head_dim = q.shape[1:]
    k_rows, v_rows = (row_scaled(c, head_dim, kv_scales) for c in (k_cache, v_cache))
    fp8 = k_cache.dtype == torch.float8_e4m3fn and not k_rows
    if fp8 and kv_scales is None:
        raise ValueError("an FP8 KV cache needs kv_scales")
    scales = kv_scales if fp8 else seq_lens  # (any tensor: not read unless FP8)
    k_scales = scale_view(k_cache, head_dim) if k_rows else seq_lens  # (likewise)
    v_scales = scale_view(v_cache, head_dim) if v_rows else seq_lens
    page_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    batch = seq_lens.shape[0]
    decodes = batch if max_query_len == 1 else num_decodes
    q = q.contiguous()
    # (a prompt step's rows past the last request's tokens: zeros, see torch_ref; the extend
    # kernel writes them)
    out = torch.empty_like(q) if max_query_len == 1 or decodes < batch else torch.zeros_like(q)
    args = (q, k_cache, v_cache, scales, k_scales, v_scales, page_table, seq_lens, cu_seqlens_q)
    # fp32 activations get exact fp32 products (no TF32), so GPU and CPU paths agree
    consts = dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
                  DIM_PAD=next_power_of_2(head_dim), PAGE_SIZE=page_size,
                  DOT_F32=_DOT_F32, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                  FP8=fp8, K_ROW=k_cache.stride(2), V_ROW=0 if fp8 else v_cache.stride(2),
                  K_SROW=k_scales.stride(2) if k_rows else 0,
                  V_SROW=v_scales.stride(2) if v_rows else 0)
    if decodes:
        _decode(args, out, scale, decodes, max_seq_len, consts)
    if decodes < batch:
        group_pad = next_power_of_2(group)
        block_m, launch = _extend_launch(max_query_len * group_pad, group_pad, fp8)
        # work items: at most one per TOKENS of the step's tokens, plus one a request
        items = cdiv(q.shape[0], block_m // group_pad) + batch - decodes
        fresh_k, fresh_v = (q, q) if fresh is None else (heads_packed(x) for x in fresh)
        extend_kernel[(items, num_kv_heads)](
            *args, out, fresh_k, fresh_v, fresh_k.stride(0), fresh_v.stride(0), scale,
            page_table.stride(0), decodes, batch, q.shape[0], GROUP_PAD=group_pad, BLOCK_M=block_m,
            FRESH=fresh is not None, **consts, **launch)
    return out


def _decode(args: tuple, out: torch.Tensor, scale: float, batch: int, max_seq_len: int,
            consts: dict) -> None:
    """The decode kernel (and the merge of its splits) for requests 0 .. batch - 1."""
    q, k_cache, v_cache, scales, _, _, page_table, seq_lens, cu_seqlens_q = args
    fp8, num_heads, head_dim = consts["FP8"], consts["NUM_HEADS"], consts["HEAD_DIM"]
    num_kv_heads, group = consts["NUM_KV_HEADS"], consts["GROUP"]
    gluon = fp8 and _FP8_GLUON and fp8_decode.fits(q, group, head_dim, consts["PAGE_SIZE"])
    launch = _DECODE_LAUNCH
    if gluon:
        block_n, min_split = 16 * fp8_decode.PAGES, _MIN_SPLIT
        splits = fp8_decode.split_count(batch, num_kv_heads, max_seq_len, q.device, _MAX_SPLITS)
    else:
        block_n = _block_n(fp8)
        splits = num_decode_splits(batch, num_kv_heads, max_seq_len, fp8)
        if splits == 1 and _unsplit_fits(q, k_cache, v_cache, consts):
            launch = dict(_UNSPLIT_LAUNCH)
            block_n = launch.pop("BLOCK_N")
        min_split = cdiv(min_split_keys(batch, num_kv_heads), block_n) * block_n
    launch_pdl = pdl(q.device)
    rows = batch * num_heads * splits if splits > 1 else 1  # partials only to merge
    partial = torch.empty(rows, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(rows, dtype=torch.float32, device=q.device)
    if gluon:
        fp8_decode._fp8_decode[(batch, num_kv_heads, splits)](
            q, k_cache.view(torch.int32), v_cache.view(torch.int32), scales, page_table,
            seq_lens, cu_seqlens_q, partial, lse, out, scale, page_table.stride(0), splits,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
            PAGE_SIZE=consts["PAGE_SIZE"], PAGES=fp8_decode.PAGES, DIRECT=splits == 1,
            MIN_SPLIT=_MIN_SPLIT, PDL=launch_pdl, num_warps=1,
            launch_pdl=launch_pdl > 0)
    else:
        _decode_kernel[(batch, num_kv_heads, splits)](
            *args, partial, lse, out, scale, page_table.stride(0), splits, min_split,
            GROUP_PAD=max(16, next_power_of_2(group)), BLOCK_N=block_n,
            DIRECT=splits == 1, PDL=launch_pdl, launch_pdl=launch_pdl > 0, **consts, **launch)
    if splits > 1:
        merge_kernel[(batch, num_heads)](
            partial, lse, out, cu_seqlens_q, seq_lens, splits, min_split, NUM_HEADS=num_heads,
            HEAD_DIM=head_dim, DIM_PAD=consts["DIM_PAD"], SPLITS_PAD=_MAX_SPLITS,
            BLOCK_N=block_n, PDL=launch_pdl, launch_pdl=launch_pdl > 0)
