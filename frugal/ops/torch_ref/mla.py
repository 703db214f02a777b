"""Multi-head latent attention over the paged latent cache, absorbed (as FlashMLA computes it).

Each token's cache entry is one row of kv_lora_rank + rope values, [latent c | rotary key]. A
head's query arrives absorbed, [q_nope · W_UK | q_rope] (the same width), so its score against
a token is q_nope · k_nope + q_rope · k_rope with k_nope = W_UK c never formed; its output is
the attention-weighted sum of the latents c, [kv_lora_rank], which W_UV turns into the head's
value after.

A static FP8 cache (float8_e4m3fn) holds row / scale saturated to ±448, one scale a layer:
kv_scales [2, 1] fp32 (row 0 is used; MLA's keys and values are the same rows). An 8-bit cache
given no kv_scales holds rows with their own scale ([.., width + 4], ops.torch_ref.kv_quant).
"""

from __future__ import annotations

import torch

from frugal.ops.torch_ref.attention import paged_attention, quantize
from frugal.ops.torch_ref.kv_quant import dequantize_rows, quantize_rows, row_scaled


def store_rows(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """rows: [num_tokens, 1, width] already in the cache's dtype -> cache [num_pages, page_size,
    1, width] (a column view is fine) at the slots (a slot < 0: not stored)."""
    keep = slot_mapping >= 0
    if cache.element_size() == 1:  # (CPU index_put has no FP8 kernel: copy the bytes)
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    cache.view(-1, *cache.shape[2:])[slot_mapping[keep]] = rows[keep]


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: torch.Tensor | None = None) -> None:
    """latent: [num_tokens, 1, width] -> cache [num_pages, page_size, 1, width] at the slots (a
    slot < 0: not stored); FP8 with kv_scales (see the module docstring)."""
    if row_scaled(cache, latent.shape[-1], kv_scales):
        store_rows(quantize_rows(latent, cache.dtype), cache, slot_mapping)
        return
    scale = None if kv_scales is None else kv_scales[0]
    store_rows(quantize(latent, scale, cache.dtype), cache, slot_mapping)


def latent_rows(cache: torch.Tensor, slots: torch.Tensor,
                kv_scales: torch.Tensor | None) -> torch.Tensor:
    """The latent rows at slots of cache [num_pages, page_size, 1, width] (a column view is
    fine): [len(slots), width] fp32; an 8-bit cache's dequantized (static: times kv_scales[0];
    given none, each row times its own scale, width then counting the scale's 4 bytes out)."""
    rows = cache.view(-1, cache.shape[-1])
    if cache.element_size() != 1:
        return rows.index_select(0, slots).float()
    picked = rows.view(torch.uint8).index_select(0, slots).view(cache.dtype)
    return dequantize_rows(picked) if kv_scales is None else picked.float() * kv_scales[0]


def dequantized_pages(cache: torch.Tensor, page_table: torch.Tensor, num_pages: int,
                      scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An 8-bit cache's pages that page_table[:, :num_pages] names, in fp32 (times scale, or
    each row times its own when scale is None), and the page table renumbered into them:
    (pages [n, page_size, 1, width], page_table)."""
    names = page_table[:, :num_pages].long().clamp(0, cache.shape[0] - 1)  # (tails: any value)
    used, renumbered = names.unique(return_inverse=True)
    pages = cache.view(torch.uint8)[used].view(cache.dtype)
    pages = dequantize_rows(pages) if scale is None else pages.float() * scale
    return pages, renumbered.view(names.shape).int()


def mla_attention(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                  max_query_len: int, max_seq_len: int, kv_lora_rank: int,
                  num_decodes: int = 0, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q: [num_tokens, num_heads, width] absorbed queries; cache [num_pages, page_size, 1,
    width] (a column view of wider rows is fine); the batch layout as paged_attention's.
    Returns [num_tokens, num_heads, kv_lora_rank] in q's dtype: each head's weighted sum of the
    latents (the first kv_lora_rank values of each entry)."""
    if cache.element_size() == 1:
        num_pages = -(-max(max_seq_len, 1) // cache.shape[1])
        own = row_scaled(cache, q.shape[-1], kv_scales)
        cache, page_table = dequantized_pages(cache, page_table, num_pages,
                                              None if own else kv_scales[0])
    out = paged_attention(q, cache, cache, page_table, cu_seqlens_q, seq_lens, scale,
                          max_query_len, max_seq_len, None, num_decodes)
    return out[..., :kv_lora_rank]
