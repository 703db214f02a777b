"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), absorbed, over a paged latent cache.

Parameter names are HF's. Per token the cache keeps [kv_a_layernorm(c) | rope(k_rope)]
(kv_lora_rank + qk_rope_head_dim values, one "KV head"); kv_b_proj's rows per head are W_UK
[qk_nope_head_dim, kv_lora_rank] then W_UV [v_head_dim, kv_lora_rank]. A head's query is
absorbed into the latent space (q_nope · W_UK), attends over the latents and rotary keys, and
its latent output goes through W_UV: the same scores and values as expanding every cached token
to full keys and values, without ever forming them.
"""

from __future__ import annotations

import torch
from torch import nn

from frugal import ops
from frugal.layers.attention import AttentionMetadata
from frugal.layers.linear import Linear
from frugal.layers.norm import RMSNorm
from frugal.layers.rotary import RotaryEmbedding, softmax_mscale
from frugal.model_config import ModelConfig


class LatentProjection(nn.Module):
    """kv_b_proj's weight [num_heads * (nope + v), kv_lora_rank], read as W_UK and W_UV per head
    (kept in the model's dtype: weight quantization leaves it)."""

    def __init__(self, rows: int, kv_lora_rank: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, kv_lora_rank), requires_grad=False)


class MlaAttention(nn.Module):
    """k_cache (= v_cache): [num_pages, page_size, 1, kv_lora_rank + qk_rope_head_dim], bound
    by the model runner."""

    def __init__(self, c: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        m = self.mla = c.mla
        self.num_heads = c.num_heads
        q_size = c.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        if m.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, q_size)
        else:
            self.q_a_proj = Linear(c.hidden_size, m.q_lora_rank, bias=c.o_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = Linear(m.q_lora_rank, q_size)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, m.kv_lora_rank + m.qk_rope_head_dim,
                                         bias=c.o_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = LatentProjection(c.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                                          m.kv_lora_rank)
        self.o_proj = Linear(c.num_heads * m.v_head_dim, c.hidden_size, bias=c.o_bias)
        self.rotary = rotary
        self.scale = ((m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
                      * softmax_mscale(c.rope_scaling))
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None

    def forward(self, h: torch.Tensor, norm: RMSNorm, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """h: [num_tokens, hidden], the residual stream -> h + attention(norm(h))."""
        m, heads = self.mla, self.num_heads
        x = norm(h)
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(-1, heads, m.qk_nope_head_dim + m.qk_rope_head_dim).split(
            [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim],
                                                           dim=-1)
        rotate = ops.apply_rotary_pairs if m.rope_interleave else ops.apply_rotary
        q_rope, k_rope = rotate(q_rope, k_rope[:, None, :], positions, self.rotary.cos_sin)
        ops.store_latent(torch.cat([self.kv_a_layernorm(latent)[:, None, :], k_rope], dim=-1),
                         self.k_cache, meta.slot_mapping)
        w = self.kv_b_proj.weight.view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk, w_uv = w.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
        q_latent = torch.einsum("thn,hnc->thc", q_nope, w_uk)
        o = ops.mla_attention(torch.cat([q_latent, q_rope], dim=-1), self.k_cache,
                              meta.page_table, meta.cu_seqlens_q, meta.seq_lens, self.scale,
                              meta.max_query_len, meta.max_seq_len, m.kv_lora_rank,
                              meta.num_decodes)
        o = torch.einsum("thc,hvc->thv", o, w_uv)
        return self.o_proj(o.reshape(-1, heads * m.v_head_dim), residual=h)
