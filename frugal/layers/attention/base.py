"""What an attention backend owns: its layers, its cache rows, its step metadata, its graphs.

A backend is one way a model attends over the paged KV cache (layers.attention.mha: multi-head
and grouped-query attention; .mla: DeepSeek's latent attention; .dsa: sparse attention over the
latent cache). The model builds each decoder layer's attention through its backend, and the
worker asks the backend what the cache holds and whether decode steps may be captured, so none
of them branches on the kind of attention.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from frugal.model_config import ModelConfig
from frugal.parallel import Parallel

# The AttentionMetadata fields every backend here reads (each names its own in metadata_fields)
STEP_FIELDS = ("slot_mapping", "page_table", "cu_seqlens_q", "seq_lens", "max_query_len",
               "max_seq_len", "num_decodes")


@dataclass(frozen=True)
class KVLayout:
    """One layer's cache on this rank: `parts` tensors (K and V: 2; MLA's latent: 1, its v is its
    k) of [num_pages, page_size, num_kv_heads, width] entries (bytes for an FP8 cache)."""

    parts: int
    num_kv_heads: int
    width: int


class AttentionBackend(ABC):
    """One kind of attention (stateless: one instance serves every model of that kind).

    name: its registry name (layers.attention.BACKENDS).
    metadata_fields: the AttentionMetadata fields its layers read; a step must fill them all.
    """

    name: ClassVar[str]
    metadata_fields: ClassVar[tuple[str, ...]] = STEP_FIELDS

    @abstractmethod
    def layer(self, c: ModelConfig, rotary: nn.Module, index: int,
              parallel: Parallel) -> nn.Module:
        """Decoder layer `index`'s attention, with HF's parameter names under `self_attn`.
        Its forward(h, norm, positions, meta, selection) -> (h + attention(norm(h)),
        selection): h [num_tokens, hidden] the residual stream, norm the layer's input RMSNorm
        (fused into the first matmul), positions [num_tokens] int64, meta AttentionMetadata,
        selection what the layer before handed on (DSA's chosen positions; None elsewhere).
        The module holding k_cache / v_cache / kv_scales (bound by the model runner) is the
        layer itself or its `attn`."""

    @abstractmethod
    def kv_layout(self, c: ModelConfig, parallel: Parallel, fp8: bool) -> KVLayout:
        """The cache a layer of this backend reads and writes on this rank (fp8: an FP8
        cache)."""

    def prompt_graphs(self, c: ModelConfig) -> str | None:
        """None when steps with prompt tokens may be captured too (worker.prompt_graphs: padded
        tokens in no request, padded requests of seq_len 0, max_query_len the token bucket),
        else why not."""
        return f"{self.name} prompts size their attention from host lengths"

    @abstractmethod
    def graph_capture(self, c: ModelConfig) -> str | None:
        """None when a decode step of this backend may be captured in a CUDA graph, else why
        not. Capturing needs every op to take its shapes from the host bounds alone (the graph
        runner passes max_query_len 1 and max_seq_len = the longest context it serves, with
        padded rows of slot -1 and seq_len 0) and to read no device value on the host."""
