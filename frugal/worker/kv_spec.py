"""The shape of one worker's KV cache, stated once: what a page holds and what it costs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from frugal.config import KV_DTYPES, CacheConfig
from frugal.layers.attention import backend_for
from frugal.model_config import ModelConfig
from frugal.parallel import SINGLE, Parallel
from frugal.worker.kv_pool import KVPool


@dataclass(frozen=True)
class KVSpec:
    """A page: num_layers x parts x [page_size, num_kv_heads, width] of dtype.

    parts: 2 (K and V) or 1 (MLA's latent rows, DSA's index key after it); num_kv_heads: this
    rank's (MLA: its one latent head, replicated on every rank); width: values a token and head
    (bytes for FP8, whose DSA rows carry the index key's scale too: ModelConfig.cache_width)."""

    num_layers: int
    parts: int
    page_size: int
    num_kv_heads: int
    width: int
    dtype: torch.dtype

    @classmethod
    def of(cls, mc: ModelConfig, cache: CacheConfig, activation_dtype: torch.dtype,
           parallel: Parallel = SINGLE) -> KVSpec:
        """The cache a config asks for ('auto' dtype: the activations')."""
        dtype = (activation_dtype if cache.kv_cache_dtype == "auto"
                 else KV_DTYPES[cache.kv_cache_dtype])
        layout = backend_for(mc).kv_layout(mc, parallel, cache.fp8)  # (its attention's rows)
        return cls(mc.num_layers, layout.parts, cache.page_size, layout.num_kv_heads,
                   layout.width, dtype)

    def unquantized(self, mc: ModelConfig, dtype: torch.dtype) -> KVSpec:
        """The same cache in dtype (no FP8 row extras): what FP8 scales are calibrated on."""
        return dataclasses.replace(self, width=mc.cache_width(False), dtype=dtype)

    @property
    def page_bytes(self) -> int:
        return KVPool.page_bytes(self.num_layers, self.page_size, self.num_kv_heads, self.width,
                                 self.dtype, self.parts)

    def pool(self, num_pages: int, device: str) -> KVPool:
        return KVPool(self.num_layers, num_pages, self.page_size, self.num_kv_heads, self.width,
                      self.dtype, device, self.parts)
