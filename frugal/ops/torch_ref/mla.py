"""Multi-head latent attention over the paged latent cache, absorbed (as FlashMLA computes it).

Each token's cache entry is one row of kv_lora_rank + rope values, [latent c | rotary key]. A
head's query arrives absorbed, [q_nope · W_UK | q_rope] (the same width), so its score against
a token is q_nope · k_nope + q_rope · k_rope with k_nope = W_UK c never formed; its output is
the attention-weighted sum of the latents c, [kv_lora_rank], which W_UV turns into the head's
value after.
"""

from __future__ import annotations

import torch

from frugal.ops.torch_ref.attention import paged_attention


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent: [num_tokens, 1, width] -> cache [num_pages, page_size, 1, width] at the slots
    (a slot < 0: not stored)."""
    keep = slot_mapping >= 0
    cache.view(-1, *cache.shape[2:])[slot_mapping[keep]] = latent[keep].to(cache.dtype)


def mla_attention(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                  max_query_len: int, max_seq_len: int, kv_lora_rank: int,
                  num_decodes: int = 0) -> torch.Tensor:
    """q: [num_tokens, num_heads, width] absorbed queries; the batch layout as
    paged_attention's. Returns [num_tokens, num_heads, kv_lora_rank] in q's dtype: each head's
    weighted sum of the latents (the first kv_lora_rank values of each entry)."""
    out = paged_attention(q, cache, cache, page_table, cu_seqlens_q, seq_lens, scale,
                          max_query_len, max_seq_len, None, num_decodes)
    return out[..., :kv_lora_rank]
