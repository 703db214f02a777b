"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), absorbed, over a paged latent cache.

Parameter names are HF's. Per token the cache keeps [kv_a_layernorm(c) | rope(k_rope)]
(kv_lora_rank + qk_rope_head_dim values, one "KV head"); kv_b_proj's rows per head are W_UK
[qk_nope_head_dim, kv_lora_rank] then W_UV [v_head_dim, kv_lora_rank]. A head's query is
absorbed into the latent space (q_nope · W_UK), attends over the latents and rotary keys, and
its latent output goes through W_UV: the same scores and values as expanding every cached token
to full keys and values, without ever forming them.

With DeepSeek Sparse Attention (ModelConfig.dsa) the row also holds the indexer's key, and a
token attends only to the positions its layer's selection names (layers.attention.dsa): chosen
here on a full layer, handed on to the shared layers after it. While no context of the step is
longer than index_topk the selection is every position, and the dense kernel computes the same
thing.

Decode steps run in CUDA graphs: the latent store is a Triton kernel and the decode counts
come from the graphs' metadata, so no op reads a device value on the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from frugal import ops
from frugal.layers.attention import AttentionMetadata, mla_prefill
from frugal.layers.attention.base import AttentionBackend, KVLayout
from frugal.layers.linear import Linear, load_whole, narrow
from frugal.layers.norm import RMSNorm
from frugal.layers.rotary import RotaryEmbedding, softmax_mscale
from frugal.model_config import LATENT_SCALE_BYTES, ModelConfig
from frugal.ops.torch_ref.kv_quant import SCALE_BYTES
from frugal.parallel import SINGLE, Parallel

if TYPE_CHECKING:
    from frugal.layers.attention.dsa import Indexer


class LatentProjection(nn.Module):
    """kv_b_proj's weight [num_heads * (nope + v), kv_lora_rank], read as W_UK and W_UV per head
    (kept in the model's dtype: weight quantization leaves it); share: the checkpoint rows of
    this rank's heads under tensor parallelism."""

    def __init__(self, rows: int, kv_lora_rank: int,
                 share: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.share = share
        self.weight = nn.Parameter(torch.empty(rows, kv_lora_rank), requires_grad=False)
        self.weight.weight_loader = self.load

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        load_whole(param, narrow(loaded, 0, self.share))


class MlaAttention(nn.Module):
    """k_cache (= v_cache): [num_pages, page_size, 1, kv_lora_rank + qk_rope_head_dim (+
    index_head_dim with DSA, + 16 bytes with DSA in FP8: ops.torch_ref.dsa)], bound by the model
    runner, with kv_scales ([2, 1] fp32) when the cache is static FP8; 8-bit rows without them
    carry their own scale after the latent (ModelConfig.cache_width). indexer: the DSA indexer of a
    layer that chooses its positions (layers.attention.dsa; None: a shared layer reuses the
    selection handed to it, or no DSA).

    Tensor parallelism splits the heads (q_b_proj / q_proj, kv_b_proj and o_proj); the latent,
    its cache and the DSA indexer are replicated on every rank, as vLLM and SGLang keep them."""

    def __init__(self, c: ModelConfig, rotary: RotaryEmbedding, parallel: Parallel = SINGLE,
                 indexer: Indexer | None = None) -> None:
        super().__init__()
        m = self.mla = c.mla
        first, self.num_heads = parallel.part(c.num_heads)
        if self.num_heads == 0:
            raise ValueError(f"tensor_parallel_size: {parallel.size} ranks for {c.num_heads} "
                             "heads")
        split = parallel.size > 1

        def heads(width: int) -> tuple[int, int] | None:  # this rank's rows of a per-head matrix
            return (first * width, self.num_heads * width) if split else None

        q_size = self.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        q_rows = heads(m.qk_nope_head_dim + m.qk_rope_head_dim)
        if m.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, q_size, rows=q_rows)
        else:
            self.q_a_proj = Linear(c.hidden_size, m.q_lora_rank, bias=c.o_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = Linear(m.q_lora_rank, q_size, rows=q_rows)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, m.kv_lora_rank + m.qk_rope_head_dim,
                                         bias=c.o_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = LatentProjection(
            self.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank,
            heads(m.qk_nope_head_dim + m.v_head_dim))
        self.o_proj = Linear(self.num_heads * m.v_head_dim, c.hidden_size, bias=c.o_bias,
                             cols=heads(m.v_head_dim), reduce=parallel)
        self.rotary = rotary
        self.scale = ((m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
                      * softmax_mscale(c.rope_scaling))
        self.dsa = c.dsa
        self.indexer = indexer
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None

    def forward(self, h: torch.Tensor, norm: RMSNorm, positions: torch.Tensor,
                meta: AttentionMetadata, selection: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h: [num_tokens, hidden], the residual stream -> (h + attention(norm(h)), the DSA
        selection for the layers after: [num_tokens, k] int32 positions, -1 for none; None while
        every position is selected or without DSA)."""
        m, heads = self.mla, self.num_heads
        x = norm(h)
        if m.q_lora_rank is None:
            q_resid, q = None, self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        q_nope, q_rope = q.view(-1, heads, m.qk_nope_head_dim + m.qk_rope_head_dim).split(
            [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim],
                                                           dim=-1)
        rotate = ops.apply_rotary_pairs if m.rope_interleave else ops.apply_rotary
        q_rope, k_rope = rotate(q_rope, k_rope[:, None, :], positions, self.rotary.cos_sin)
        width = m.kv_lora_rank + m.qk_rope_head_dim
        # 8-bit rows given no kv_scales carry their own scale (ops.torch_ref.kv_quant), padded
        own = self.kv_scales is None and self.k_cache.element_size() == 1
        cache = self.k_cache[..., :width + (SCALE_BYTES if own else 0)]
        index = self.k_cache[..., width + (LATENT_SCALE_BYTES if own else 0):]
        ops.store_latent(torch.cat([self.kv_a_layernorm(latent)[:, None, :], k_rope], dim=-1),
                         cache, meta.slot_mapping, self.kv_scales)
        if self.indexer is not None:  # (a shared layer's index columns stay zero)
            ops.store_index_key(self.indexer.key(x, positions), index, meta.slot_mapping)
        w = self.kv_b_proj.weight.view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk, w_uv = w.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
        sparse = self.dsa is not None and meta.max_seq_len > self.dsa.topk
        key_dim = m.qk_nope_head_dim + m.qk_rope_head_dim  # (values padded to it)
        if (not sparse and not meta.captured and m.v_head_dim <= key_dim
                and mla_prefill.fits(meta, heads, key_dim, m.qk_nope_head_dim + m.v_head_dim,
                                     width, q.dtype)):
            o = self.decodes_and_prompts(q_nope, q_rope, cache, w, meta)
            return self.o_proj(o.reshape(-1, heads * m.v_head_dim), residual=h), None
        q_latent = torch.cat([torch.einsum("thn,hnc->thc", q_nope, w_uk), q_rope], dim=-1)
        if sparse:
            if self.indexer is not None:
                selection = self.indexer.select(x, q_resid, positions, index, meta)
            o = ops.sparse_mla_attention(q_latent, cache, meta.page_table, meta.cu_seqlens_q,
                                         selection, self.scale, m.kv_lora_rank, self.kv_scales)
        elif meta.captured:  # (a CUDA-graph step with prompt tokens: no host-read sizes)
            selection = None
            o = self.rows_absorbed(q_latent, cache, positions, meta)
        else:
            selection = None
            o = ops.mla_attention(q_latent, cache, meta.page_table, meta.cu_seqlens_q,
                                  meta.seq_lens, self.scale, meta.max_query_len,
                                  meta.max_seq_len, m.kv_lora_rank, meta.num_decodes,
                                  self.kv_scales)
        o = torch.einsum("thc,hvc->thv", o, w_uv)
        return self.o_proj(o.reshape(-1, heads * m.v_head_dim), residual=h), selection

    def rows_absorbed(self, q_latent: torch.Tensor, cache: torch.Tensor,
                      positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Every new token attended absorbed as a row of its own (shapes from host bounds only,
        as a CUDA graph needs): its request's pages, the positions up to its own; a padded
        token (in no request) reads nothing and gets zeros. q_latent [T, heads, latent + rope]
        -> [T, heads, latent]."""
        t, requests = q_latent.shape[0], meta.seq_lens.shape[0]
        rows = torch.arange(t, dtype=meta.cu_seqlens_q.dtype, device=q_latent.device)
        request = torch.searchsorted(meta.cu_seqlens_q[1:].contiguous(), rows, right=True)
        seq_lens = torch.where(request < requests, positions + 1, 0).to(torch.int32)
        page_table = meta.page_table[request.clamp(max=requests - 1)]
        return ops.mla_attention(q_latent, cache, page_table,
                                 torch.arange(t + 1, dtype=torch.int32, device=rows.device),
                                 seq_lens, self.scale, 1, meta.max_seq_len,
                                 self.mla.kv_lora_rank, t, self.kv_scales)

    def decodes_and_prompts(self, q_nope: torch.Tensor, q_rope: torch.Tensor,
                            cache: torch.Tensor, w: torch.Tensor, meta: AttentionMetadata
                            ) -> torch.Tensor:
        """A step with prompt rows, dense: its num_decodes decodes absorbed (one token each,
        first), its prompt requests expanded (layers.attention.mla_prefill). Returns
        [num_tokens, heads, v_head_dim]."""
        m, d = self.mla, meta.num_decodes
        w_uk, w_uv = w.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
        o = torch.empty(*q_nope.shape[:2], m.v_head_dim, dtype=q_nope.dtype,
                        device=q_nope.device)
        if d:
            q_latent = torch.cat([torch.einsum("thn,hnc->thc", q_nope[:d], w_uk), q_rope[:d]],
                                 dim=-1)
            latent = ops.mla_attention(q_latent, cache, meta.page_table[:d],
                                       meta.cu_seqlens_q[:d + 1], meta.seq_lens[:d], self.scale,
                                       1, meta.max_seq_len, m.kv_lora_rank, d, self.kv_scales)
            o[:d] = torch.einsum("thc,hvc->thv", latent, w_uv)
        o[d:] = mla_prefill.attend(torch.cat([q_nope[d:], q_rope[d:]], dim=-1), cache,
                                   self.kv_scales, w, m.kv_lora_rank, m.v_head_dim, self.scale,
                                   meta)
        return o


class MlaBackend(AttentionBackend):
    name = "mla"

    def layer(self, c: ModelConfig, rotary: RotaryEmbedding, index: int,
              parallel: Parallel) -> MlaAttention:
        return MlaAttention(c, rotary, parallel)

    def kv_layout(self, c: ModelConfig, parallel: Parallel, fp8: bool) -> KVLayout:
        """One part (v is k): the latent and the rotary key, head_dim wide (ModelConfig sets it
        so), in one "KV head" replicated on every rank."""
        return KVLayout(parts=1, num_kv_heads=c.num_kv_heads, width=c.cache_width(fp8))

    def graph_capture(self, c: ModelConfig) -> str | None:
        return None

    def prompt_graphs(self, c: ModelConfig) -> str | None:
        return None  # (captured prompt steps attend absorbed, a row a token: rows_absorbed)


BACKEND = MlaBackend()
