"""The lightning indexer of DeepSeek Sparse Attention (GLM-5, DeepSeek-V3.2), HF's names.

For each query token it scores every cached token of its request with index_n_heads small heads,
score(t, s) = sum_h w_h(t) * ReLU(q_h(t) . k(s)) / sqrt(index_n_heads * index_head_dim), and
keeps the top `index_topk` positions the token may see; MLA then attends over those alone. The
indexer's key k(s) (one index_head_dim vector a token: LayerNorm(wk x), its first
qk_rope_head_dim dims rotated in adjacent pairs) sits in the latent cache's row after the latent
and rotary key, so it lives, moves and is checked with its page.

The backend: MLA's layers (layers.attention.mla), each full layer with an Indexer of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from frugal import ops
from frugal.layers.attention import AttentionMetadata
from frugal.layers.attention.mla import MlaAttention, MlaBackend
from frugal.layers.linear import Linear
from frugal.layers.rotary import RotaryEmbedding
from frugal.model_config import ModelConfig
from frugal.parallel import Parallel


class Indexer(nn.Module):
    """wq_b [heads * dim, q_lora_rank], wk [dim, hidden], k_norm (LayerNorm, eps 1e-6, with
    bias), weights_proj [heads, hidden] (applied in fp32, as transformers keeps it)."""

    def __init__(self, c: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        d = self.dsa = c.dsa
        self.rope_dim = c.mla.qk_rope_head_dim
        self.wq_b = Linear(c.mla.q_lora_rank, d.num_heads * d.head_dim)
        self.wk = Linear(c.hidden_size, d.head_dim)
        self.k_norm = nn.LayerNorm(d.head_dim, eps=1e-6)
        self.k_norm.requires_grad_(False)
        self.weights_proj = nn.Module()
        self.weights_proj.weight = nn.Parameter(torch.empty(d.num_heads, c.hidden_size),
                                                requires_grad=False)
        self.rotary = rotary
        # (ReLU commutes with a positive scale: both of transformers' scales fold into w)
        self.scale = (d.num_heads * d.head_dim) ** -0.5

    def key(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden] (the normed input) -> the tokens' index keys [num_tokens,
        head_dim] in x's dtype, to store in the cache row."""
        k = self.k_norm(self.wk(x))
        return self._rotate(k[:, None, :], positions)[:, 0]

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor,
               keys: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: [num_tokens, hidden]; q_resid: [num_tokens, q_lora_rank] (q_a_layernorm's output);
        keys: the cache's index-key columns [num_pages, page_size, 1, head_dim], this step's
        stored. Returns [num_tokens, min(topk, max_seq_len)] int32: each token's chosen
        positions in its request, -1 past the ones it can see."""
        d = self.dsa
        q = self.wq_b(q_resid).view(-1, d.num_heads, d.head_dim)
        q = self._rotate(q, positions)
        weights = F.linear(x.float(), self.weights_proj.weight.float()) * self.scale
        # (no host seq_lens: a CUDA graph's step, max_seq_len the longest context it serves)
        return ops.index_topk(q, weights, keys, meta.page_table, meta.cu_seqlens_q,
                              meta.seq_lens, d.topk, meta.max_seq_len,
                              bound=meta.host_seq_lens is None)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, heads, head_dim], its first rope_dim dims rotated (pairs)."""
        r = self.rope_dim
        rot, _ = ops.apply_rotary_pairs(x[..., :r], x[:, :1, :r], positions,
                                        self.rotary.cos_sin)
        return torch.cat([rot, x[..., r:]], dim=-1)


class DsaBackend(MlaBackend):
    """MLA's layers and cache row (its head_dim counts the index key; an FP8 row also keeps
    the key's scale: ModelConfig.cache_width), an Indexer on each full layer."""

    name = "dsa"

    def layer(self, c: ModelConfig, rotary: RotaryEmbedding, index: int,
              parallel: Parallel) -> MlaAttention:
        indexer = Indexer(c, rotary) if index in c.dsa.full_layers else None
        return MlaAttention(c, rotary, parallel, indexer)

    def graph_capture(self, c: ModelConfig) -> str | None:
        """In a graph max_seq_len is the longest context served: the sparse path always runs,
        and a short context's selection is padded with -1 (index_topk), which attends to what
        the dense path would."""
        return None

    def prompt_graphs(self, c: ModelConfig) -> str | None:
        return "dsa prompts select their positions through host-sized top-k paths"


BACKEND = DsaBackend()
