"""Attention over the paged KV cache; the step's batch layout travels in AttentionMetadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from frugal import ops


@dataclass
class AttentionMetadata:
    """How a step's tokens map onto requests and pages (all on the model's device).

    slot_mapping: [num_tokens] int64, where each new token's K/V is written;
    page_table: [num_requests, max_pages] int32; cu_seqlens_q: [num_requests + 1] int32;
    seq_lens: [num_requests] int32, each request's context length after this step;
    max_query_len, max_seq_len: host-side bounds of the new tokens and of seq_lens;
    num_decodes: how many requests at the front of the batch have one new token each.
    """

    slot_mapping: torch.Tensor
    page_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_decodes: int = 0


class Attention(nn.Module):
    """Rotates q and k, stores this step's K/V, then attends over each request's cached context.

    k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim], bound by the model runner,
    with kv_scales ([2, num_kv_heads] fp32, K then V) when the cache is FP8, else None.
    rotary: the model's shared RotaryEmbedding (its cos_sin table).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: nn.Module) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rotary = rotary
        self.scale = head_dim ** -0.5
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        (views of a fused projection are fine); positions: [num_tokens] int64."""
        q = ops.rotary_store_kv(q, k, v, positions, self.rotary.cos_sin, self.k_cache,
                                self.v_cache, meta.slot_mapping, self.kv_scales)
        return ops.paged_attention(q, self.k_cache, self.v_cache, meta.page_table,
                                   meta.cu_seqlens_q, meta.seq_lens, self.scale,
                                   meta.max_query_len, meta.max_seq_len, self.kv_scales,
                                   meta.num_decodes)
