"""Paged KV store and paged attention by gathering pages (one request at a time)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new keys/values into their slots.

    k, v: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_pages, page_size,
    num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64, slot = page_id * page_size + offset.
    """
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole cached context.

    q: [num_tokens, num_heads, head_dim], the new tokens of all requests back to back;
    page_table: [num_requests, max_pages] int32, page ids of each request (unused tail: any value);
    cu_seqlens_q: [num_requests + 1] int32, request b's new tokens are q[cu[b]:cu[b+1]];
    seq_lens: [num_requests] int32, context length after this step (cached + new; the new tokens'
    K/V must already be stored). New token i of request b sits at position seq_lens[b] - n_b + i and
    attends to positions <= its own. Returns [num_tokens, num_heads, head_dim] in q's dtype.
    """
    page_size = k_cache.shape[1]
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        num_new = end - start
        pages = page_table[b, :(seq_len + page_size - 1) // page_size].long()
        k = k_cache[pages].flatten(0, 1)[:seq_len].transpose(0, 1).to(q.dtype)
        v = v_cache[pages].flatten(0, 1)[:seq_len].transpose(0, 1).to(q.dtype)
        qb = q[start:end].transpose(0, 1)  # [num_heads, num_new, head_dim]
        mask = None
        if num_new > 1:
            mask = torch.ones(num_new, seq_len, dtype=torch.bool, device=q.device).tril(
                seq_len - num_new)
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out
