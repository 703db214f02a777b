"""Paged KV store and paged attention by gathering pages.

Single-token (decode) requests are attended together in one padded batch; requests with several
new tokens (prefill chunks) one at a time. Grouped-query attention is done by folding each KV
head's query group into the query axis, so K/V are never repeated.

A static FP8 cache (float8_e4m3fn) comes with kv_scales: [2, num_kv_heads] fp32, row 0 for K,
row 1 for V; the cache holds x / scale, saturated to ±448 (never NaN), and reads back as
fp8 · scale. Its V is key-minor: [num_pages, num_kv_heads, head_dim, page_size] (see
v_key_minor). An 8-bit cache part given no kv_scales carries a scale in each row instead
(ops.torch_ref.kv_quant: e4m3 or int8, [..., head_dim + 4]); K and V may differ (K in the
activation dtype, V 8-bit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from frugal.ops.torch_ref.kv_quant import dequantize_rows, quantize_rows, row_scaled
from frugal.ops.torch_ref.norm import rms_norm
from frugal.ops.torch_ref.rotary import apply_rotary
from frugal.quant.fp8 import FP8_MAX


def v_key_minor(dtype: torch.dtype) -> bool:
    """Whether a V cache of this dtype is laid out key-minor, [num_pages, num_kv_heads, head_dim,
    page_size], rather than [num_pages, page_size, num_kv_heads, head_dim] (as K always is).
    FP8 is: 8-bit P·V operands are read from shared memory whole only when the keys of a row
    are contiguous (measured 1.2-1.3x faster decode attention on the H200)."""
    return dtype == torch.float8_e4m3fn


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [num_tokens, num_kv_heads, head_dim] -> the cache's dtype; for FP8, x / scale ([heads])
    saturated to the FP8 range, NaN stored as 0 (an FP8 cache never holds NaN)."""
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    if scale is None:
        raise ValueError("an FP8 KV cache needs kv_scales")
    y = (x.float() / scale[None, :, None]).nan_to_num(nan=0.0)
    return y.clamp(-FP8_MAX, FP8_MAX).to(dtype)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
    """Write new keys/values into their slots.

    k, v: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_pages, page_size,
    num_kv_heads, head_dim] (an FP8 V: key-minor); slot_mapping: [num_tokens] int64, slot =
    page_id * page_size + offset. kv_scales: [2, num_kv_heads] for an FP8 cache (see the module
    docstring).
    """
    for x, cache, row in ((k, k_cache, 0), (v, v_cache, 1)):
        if row_scaled(cache, x.shape[-1], kv_scales):
            x, minor = quantize_rows(x, cache.dtype), False
        else:
            x = quantize(x, kv_scales[row] if kv_scales is not None else None, cache.dtype)
            minor = row == 1 and v_key_minor(cache.dtype)
        if cache.element_size() == 1:  # (CPU index_copy_ has no FP8 kernel: copy the bytes)
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        if minor:
            page_size = cache.shape[3]
            cache[slot_mapping // page_size, :, :, slot_mapping % page_size] = x
        else:
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x)


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None = None,
                    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                    k_out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate q and k (see apply_rotary), store the rotated k and v (see store_kv; a negative
    slot skips its token) and return the rotated q: [num_tokens, num_heads, head_dim].
    qk_norm (q's weight [head_dim], k's, eps): each head of q and k RMS-normalized first (Qwen3,
    as its q_norm and k_norm). k_out: None, or [num_tokens, num_kv_heads, head_dim] in q's
    dtype, written with every token's rotated k (negative slots too), as the cache would hold
    it unquantized (paged_attention's fresh keys)."""
    if qk_norm is not None:
        q, k = rms_norm(q, qk_norm[0], qk_norm[2]), rms_norm(k, qk_norm[1], qk_norm[2])
    q, k = apply_rotary(q, k, positions, cos_sin)
    if k_out is not None:
        k_out.copy_(k)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    store_kv(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    return q


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, max_query_len: int, max_seq_len: int,
                    kv_scales: torch.Tensor | None = None, num_decodes: int = 0,
                    fresh: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole cached context.

    q: [num_tokens, num_heads, head_dim], the new tokens of all requests back to back;
    page_table: [num_requests, max_pages] int32, page ids of each request (unused tail: any value);
    cu_seqlens_q: [num_requests + 1] int32, request b's new tokens are q[cu[b]:cu[b+1]];
    seq_lens: [num_requests] int32, context length after this step (cached + new; the new tokens'
    K/V must already be stored). New token i of request b sits at position seq_lens[b] - n_b + i and
    attends to positions <= its own. max_query_len, max_seq_len: host-side bounds of n_b and
    seq_lens (GPU kernels size their grids with them). Returns [num_tokens, num_heads, head_dim]
    in q's dtype (zeros for a request with seq_len 0). kv_scales: [2, num_kv_heads] for an FP8
    cache. num_decodes: the first num_decodes requests have one new token each (kernels may run
    them apart; the result is the same). Rows past cu_seqlens_q[-1] (a padded step's, see
    worker.prompt_graphs): zeros when max_query_len > 1, else left as they are.

    fresh: None, or (k, v), each [num_tokens, num_kv_heads, head_dim] in q's dtype: the step's
    rotated keys and values as computed (row i: q row i's token). A request b with n_b > 1 new
    tokens then reads positions < seq_lens[b] - n_b from the cache and its own new tokens from
    fresh (unquantized: a quantized cache changes only what came before the step). Requests
    with one new token (decodes) read the cache, as every later step reads them. Over an
    unquantized cache the result is the same as without fresh.
    """
    out = torch.empty_like(q) if max_query_len == 1 else torch.zeros_like(q)
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    num_new = [b - a for a, b in zip(starts, starts[1:])]
    single = [b for b, n in enumerate(num_new) if n == 1]
    if single:
        rows = torch.tensor([starts[b] for b in single], device=q.device)
        index = torch.tensor(single, device=q.device)
        out[rows] = _attend(q[rows].unsqueeze(1), k_cache, v_cache, page_table[index],
                            seq_lens[index], max(lens[b] for b in single), scale,
                            kv_scales).squeeze(1)
    for b, n in enumerate(num_new):
        if n > 1:
            s, e = starts[b], starts[b + 1]
            own = None if fresh is None else (fresh[0][s:e], fresh[1][s:e])
            out[s:e] = _attend(q[s:e].unsqueeze(0), k_cache, v_cache, page_table[b:b + 1],
                               seq_lens[b:b + 1], lens[b], scale, kv_scales, own).squeeze(0)
    return out


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            page_table: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
            scale: float, kv_scales: torch.Tensor | None,
            fresh: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q: [B, n, num_heads, head_dim], every request with the same n new tokens (the last n of its
    context). Returns [B, n, num_heads, head_dim], computed in fp32; zeros for a token with
    nothing to attend to (seq_len 0: a request masked by the integrity check). fresh (B == 1,
    seq_len max_len): the n new tokens' K and V [n, num_kv_heads, head_dim], read instead of
    the cache's copies."""
    if max_len == 0:
        return torch.zeros_like(q)
    batch, n, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]  # (K: never key-minor)
    group = num_heads // num_kv_heads
    positions = torch.arange(max_len, device=q.device)
    lengths = seq_lens[:, None].long()
    valid = positions[None, :] < lengths  # [B, L]
    # Gather token slots; a position past a request's length reads its position 0 instead (always
    # written, so finite) and is masked out below: stale slots may hold anything, even NaN.
    pages = page_table.long().gather(1, (positions // page_size).expand(batch, -1))
    slots = torch.where(valid, pages * page_size + positions % page_size,
                        page_table[:, :1].long() * page_size)
    flat = slots.flatten()  # index_select: several times faster than advanced indexing on CPU
    k, v = (_gather(cache, flat, None if kv_scales is None else kv_scales[row],
                    row == 1 and v_key_minor(cache.dtype) and kv_scales is not None,
                    row_scaled(cache, head_dim, kv_scales))
            .view(batch, max_len, num_kv_heads, head_dim)  # [B, L, Hkv, D] fp32
            for cache, row in ((k_cache, 0), (v_cache, 1)))
    if fresh is not None:
        k[0, max_len - n:], v[0, max_len - n:] = fresh[0].float(), fresh[1].float()
    q_pos = lengths - n + torch.arange(n, device=q.device)  # [B, n]
    allowed = valid[:, None, :] & (positions[None, None, :] <= q_pos[:, :, None])  # [B, n, L]
    # GQA: a KV head's whole query group becomes group * n query rows attending to that head
    qg = q.float().reshape(batch, n, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(batch, num_kv_heads, group * n, head_dim)
    mask = allowed[:, None, None].expand(batch, 1, group, n, max_len).reshape(
        batch, 1, group * n, max_len)
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=scale)  # [B, Hkv, group * n, D]
    out = out.reshape(batch, num_kv_heads, group, n, head_dim).permute(0, 3, 1, 2, 4)
    out = torch.where(allowed.any(-1)[:, :, None, None, None], out, 0.0)
    return out.reshape(batch, n, num_heads, head_dim).to(q.dtype)


def _gather(cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None,
            key_minor: bool = False, scaled_rows: bool = False) -> torch.Tensor:
    """Rows [len(slots), heads, dim] of cache [num_pages, page_size, heads, dim] (key_minor:
    [num_pages, heads, dim, page_size]) at slots, in fp32 (FP8 times scale; scaled_rows: each
    row times its own scale)."""
    if key_minor:
        page_size = cache.shape[3]
        picked = cache.view(torch.uint8)[slots // page_size, :, :, slots % page_size]
        return picked.view(cache.dtype).float() * scale[None, :, None]
    rows = cache.view(-1, *cache.shape[2:])
    if scaled_rows:
        return dequantize_rows(rows.view(torch.uint8).index_select(0, slots).view(cache.dtype))
    if cache.element_size() != 1:
        return rows.index_select(0, slots).float()
    picked = rows.view(torch.uint8).index_select(0, slots).view(cache.dtype)
    return picked.float() * scale[None, :, None]
