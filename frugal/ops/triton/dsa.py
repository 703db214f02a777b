"""DeepSeek Sparse Attention on the GPU: the indexer's scores as one Triton kernel, their top-k
(ops.triton.topk's radix select for rows of RADIX_MIN positions or more while the step's scores
are at most RADIX_MAX or a CUDA graph's step, its first pass counted by the score kernel,
which also cuts each row at what its token sees; torch.topk otherwise), and
MLA over the selected positions (mla_decode's kernel, SPARSE).

The score kernel takes one new token and CHUNKS blocks of BLOCK_N of its request's positions a
program, one block after the other: the token's index queries [heads, dim] (loaded once) against
the keys gathered from the cache rows ([BLOCK_N, dim]), ReLU, the per-head weights summed in,
-inf past the positions the token sees. With CHUNKS > 1 the block loop is Triton's to pipeline:
compiled for sm_90 the key gathers become cp.async, the next blocks' loads in flight during this
block's dot (one block a program: plain loads, the dot waiting on them). Twins:
torch_ref.index_topk and torch_ref.sparse_mla_attention.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from frugal.ops import torch_ref
from frugal.ops.triton.mla_decode import mla_decode
from frugal.ops.triton.mla_decode import supported as mla_supported
from frugal.ops.triton.sizes import cdiv
from frugal.ops.triton.token_rows import page_slot, token_request
from frugal.ops.triton.topk import DEAD, count_first_bytes, top_positions, work_area

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_N = 128  # positions of a score block (64-256 measured: 128 by up to 8 %)
NUM_WARPS = 4
CHUNKS = 1  # blocks of BLOCK_N positions a score program takes in turn
# The radix select where it beat torch.topk (k = 2,048; H100, 1-64 rows of 8k-128k): 20-24 us
# against 44-80 at one row, 67 against 76 at 16 rows of 128k; 121 against 96 at 64 rows of 64k
RADIX_MIN, RADIX_MAX = 8192, 1 << 21  # positions a row, scores a step


# (the step's page-table width and longest context change from step to step: one variant)
@triton.jit(do_not_specialize=["num_requests", "spt", "num_cols"])
def _score_kernel(q_ptr, w_ptr, keys_ptr, key_scales_ptr, page_table_ptr, cu_ptr, seq_lens_ptr,
                  num_requests, out_ptr, work_ptr, sqt, sqh, swt, srow, sscale, spt, sot, s_work,
                  num_cols, PAGE_SIZE: tl.constexpr, HEADS: tl.constexpr, DIM: tl.constexpr,
                  FP8: tl.constexpr, F32_DOT: tl.constexpr, BLOCK_N: tl.constexpr,
                  CHUNKS: tl.constexpr, FIRST_PASS: tl.constexpr):
    """Token t's scores over CHUNKS · BLOCK_N positions. Token t of request b (token_request)
    sees the positions before seq_lens[b] - (cu[b + 1] - t) and its own; a row past the step's
    tokens (cu[num_requests] and on) sees none. FIRST_PASS: the radix top-k's first pass over
    them too, into the token's row of the work area (topk.count_first_bytes), and its dead tail
    (num_cols - visible); programs past what the token sees then store nothing and return."""
    t = tl.program_id(0)
    b = token_request(cu_ptr, num_requests, t)
    end = tl.load(cu_ptr + b + 1)
    visible = tl.where(t < end, tl.load(seq_lens_ptr + b) - (end - t) + 1, 0)
    if FIRST_PASS:
        if tl.program_id(1) == 0:
            tl.store(work_ptr + t * s_work + DEAD, num_cols - tl.minimum(visible, num_cols))
        if tl.program_id(1) * CHUNKS * BLOCK_N >= visible:
            return
    heads = tl.arange(0, HEADS)
    dims = tl.arange(0, DIM)
    q = tl.load(q_ptr + t * sqt + heads[:, None] * sqh + dims[None, :])
    w = tl.load(w_ptr + t * swt + heads)
    for c in range(CHUNKS):
        pos = (tl.program_id(1) * CHUNKS + c) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = pos < visible
        page = tl.load(page_table_ptr + b * spt + pos // PAGE_SIZE, mask=ok, other=0)
        slot = page_slot(page.to(tl.int64), pos, PAGE_SIZE)
        k = tl.load(keys_ptr + slot[:, None] * srow + dims[None, :], mask=ok[:, None],
                    other=0.0)
        if FP8:
            k = k.to(q.dtype)
        if F32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [HEADS, BLOCK_N] fp32
        if FP8:
            s = s * tl.load(key_scales_ptr + slot * sscale, mask=ok, other=0.0)[None, :]
        score = tl.where(ok, tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0), float("-inf"))
        tl.store(out_ptr + t * sot + pos, score, mask=pos < num_cols)
        if FIRST_PASS:  # (the scores stored: the row the top-k reads)
            count_first_bytes(tl.where(pos < num_cols, score, float("-inf")),
                              work_ptr + t * s_work)


def supported(heads: int, dim: int) -> bool:
    """tl.dot's shapes: powers of two of at least 16."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (heads, dim))


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                 page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                 max_seq_len: int, work: torch.Tensor | None = None) -> torch.Tensor:
    """[num_tokens, max_seq_len] fp32 index scores (-inf where a token sees no position).
    work: a topk.work_area of num_tokens rows that the radix top-k's first pass is counted
    into (then top_positions(scores, k, work=work)), with each row's dead tail; the blocks of
    BLOCK_N · CHUNKS positions past what a token sees are then left unwritten."""
    num_tokens, heads, dim = q.shape
    # (rows padded to 16 scores: their stride, a multiple of 16 at any context, is one variant)
    out = torch.empty(num_tokens, cdiv(max_seq_len, 16) * 16, dtype=torch.float32,
                      device=q.device)[:, :max_seq_len]
    fp8 = keys.element_size() == 1
    # an FP8 key's fp32 scale follows its dim bytes (torch_ref.dsa): a strided fp32 view
    key_scales = keys.view(torch.uint8)[..., dim:dim + 4].view(torch.float32) if fp8 else out
    grid = (num_tokens, cdiv(max_seq_len, BLOCK_N * CHUNKS))
    _score_kernel[grid](q, weights, keys, key_scales, page_table, cu_seqlens_q, seq_lens,
                        seq_lens.shape[0], out, work if work is not None else seq_lens,
                        q.stride(0), q.stride(1), weights.stride(0), keys.stride(1),
                        key_scales.stride(1) if fp8 else 0, page_table.stride(0),
                        out.stride(0), work.stride(0) if work is not None else 0, max_seq_len,
                        PAGE_SIZE=keys.shape[1], HEADS=heads, DIM=dim, FP8=fp8,
                        F32_DOT=_INTERPRET or q.dtype == torch.float32, BLOCK_N=BLOCK_N,
                        CHUNKS=CHUNKS, FIRST_PASS=work is not None, num_warps=NUM_WARPS)
    return out


def index_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
               topk: int, max_seq_len: int, bound: bool = False) -> torch.Tensor:
    """torch_ref.index_topk's twin. With bound (a CUDA graph's step, in its capture and in the
    run before it that compiles its kernels) the radix select runs whatever the step's scores:
    its rows cost the contexts' own lengths, torch.topk's the bound."""
    if not supported(q.shape[1], q.shape[2]):
        return torch_ref.index_topk(q, weights, keys, page_table, cu_seqlens_q, seq_lens, topk,
                                    max_seq_len)
    radix = max_seq_len >= RADIX_MIN and (bound or q.shape[0] * max_seq_len <= RADIX_MAX)
    work = work_area(q.shape[0], q.device) if radix else None
    scores = index_scores(q, weights, keys, page_table, cu_seqlens_q, seq_lens, max_seq_len,
                          work)
    if radix:  # (its first pass counted by the score kernel)
        return top_positions(scores, min(topk, max_seq_len), work=work)
    # (unsorted: the selection's order does not matter, 20 us less at one request of 128k)
    values, picked = scores.topk(min(topk, max_seq_len), dim=-1, sorted=False)
    return torch.where(values == float("-inf"), -1, picked).to(torch.int32)


def sparse_mla_attention(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, selection: torch.Tensor, scale: float,
                         kv_lora_rank: int, kv_scales: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """torch_ref.sparse_mla_attention's twin: every token (decode or prompt) one kernel row."""
    if not mla_supported(kv_lora_rank, q.shape[-1] - kv_lora_rank):
        return torch_ref.sparse_mla_attention(q, cache, page_table, cu_seqlens_q, selection,
                                              scale, kv_lora_rank, kv_scales)
    return mla_decode(q, cache, page_table, page_table, scale, 0, kv_lora_rank, selection,
                      cu_seqlens_q, kv_scales)
