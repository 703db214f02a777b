"""Multi-head and grouped-query attention (Llama, Qwen, Mistral, GLM-4.5) over a paged K/V cache.

Decode steps are captured in CUDA graphs: the Triton kernels size their grids from the host
bounds and find each request's context from its seq_len on the device.
"""

from __future__ import annotations

import torch
from torch import nn

from frugal import ops
from frugal.layers.attention import AttentionMetadata
from frugal.layers.attention.base import STEP_FIELDS, AttentionBackend, KVLayout
from frugal.layers.linear import Linear, MergedLinear
from frugal.layers.norm import RMSNorm
from frugal.layers.rotary import RotaryEmbedding
from frugal.model_config import ModelConfig
from frugal.parallel import SINGLE, Parallel


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
                meta: AttentionMetadata,
                qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        (views of a fused projection are fine); positions: [num_tokens] int64; qk_norm: q's
        and k's RMSNorm weights [head_dim] and eps, applied per head before the rotary
        (fused into the store).

        Over an 8-bit cache (either part), a step's prompt tokens attend to one another's K/V
        as computed (the rotated k handed back by the store, v as given) and only to the
        context before them through the cache, unless meta.fresh_kv is off."""
        fresh_k = None
        if meta.fresh_kv and meta.max_query_len > 1 and (
                self.k_cache.element_size() == 1 or self.v_cache.element_size() == 1):
            fresh_k = torch.empty(k.shape, dtype=q.dtype, device=q.device)
        q = ops.rotary_store_kv(q, k, v, positions, self.rotary.cos_sin, self.k_cache,
                                self.v_cache, meta.slot_mapping, self.kv_scales, qk_norm,
                                fresh_k)
        return ops.paged_attention(q, self.k_cache, self.v_cache, meta.page_table,
                                   meta.cu_seqlens_q, meta.seq_lens, self.scale,
                                   meta.max_query_len, meta.max_seq_len, self.kv_scales,
                                   meta.num_decodes, None if fresh_k is None else (fresh_k, v))


class MhaAttention(nn.Module):
    """A decoder layer's attention: fused q/k/v projection (optional qk-norm), Attention, o_proj.
    Under tensor parallelism a rank holds a share of the KV heads with their query groups."""

    def __init__(self, c: ModelConfig, rotary: RotaryEmbedding,
                 parallel: Parallel = SINGLE) -> None:
        super().__init__()
        group, d = c.num_heads // c.num_kv_heads, c.head_dim
        kv_start, kv_heads = parallel.part(c.num_kv_heads)
        if kv_heads == 0:
            raise ValueError(f"tensor_parallel_size: {parallel.size} ranks for "
                             f"{c.num_kv_heads} KV heads")
        self.num_heads, self.num_kv_heads, self.head_dim = kv_heads * group, kv_heads, d
        q_size, kv_size = self.num_heads * d, kv_heads * d
        q_rows, kv_rows = (kv_start * group * d, q_size), (kv_start * d, kv_size)
        split = parallel.size > 1
        self.qkv_proj = MergedLinear(c.hidden_size, [q_size, kv_size, kv_size], ["q", "k", "v"],
                                     bias=c.qkv_bias,
                                     shard_rows=[q_rows, kv_rows, kv_rows] if split else None)
        self.o_proj = Linear(q_size, c.hidden_size, bias=c.o_bias, cols=q_rows if split else None,
                             reduce=parallel)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.attn = Attention(c.num_heads, c.num_kv_heads, c.head_dim, rotary)

    def forward(self, h: torch.Tensor, norm: RMSNorm, positions: torch.Tensor,
                meta: AttentionMetadata, selection: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, None]:
        """h: [num_tokens, hidden], the residual stream -> (h + attention(norm(h)), None: no
        selection to hand on)."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(h, norm=norm))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        qk_norm = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight,
                                                    self.q_norm.eps)
        o = self.attn(q, k, v, positions, meta, qk_norm)
        return self.o_proj(o.reshape(-1, self.num_heads * self.head_dim), residual=h), None


class MhaBackend(AttentionBackend):
    name = "mha"
    metadata_fields = (*STEP_FIELDS, "fresh_kv")

    def layer(self, c: ModelConfig, rotary: RotaryEmbedding, index: int,
              parallel: Parallel) -> MhaAttention:
        return MhaAttention(c, rotary, parallel)

    def kv_layout(self, c: ModelConfig, parallel: Parallel, fp8: bool) -> KVLayout:
        """K and V of this rank's KV heads (tensor parallelism splits them), head_dim wide."""
        return KVLayout(parts=2, num_kv_heads=parallel.part(c.num_kv_heads)[1],
                        width=c.head_dim)

    def graph_capture(self, c: ModelConfig) -> str | None:
        return None

    def prompt_graphs(self, c: ModelConfig) -> str | None:
        return None


BACKEND = MhaBackend()
