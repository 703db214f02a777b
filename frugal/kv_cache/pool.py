"""The physical KV pool: one K and one V tensor per layer, sized from a memory budget."""

from __future__ import annotations

import logging

import torch

from frugal.ops.torch_ref.attention import v_key_minor

logger = logging.getLogger("frugal")


class KVPool:
    """K/V storage for every layer (parts 1: one tensor a layer, v[layer] is k[layer]: MLA's
    latent cache).

    k[layer], v[layer]: [num_pages, page_size, num_kv_heads, head_dim] of `dtype` (an FP8 v:
    key-minor, [num_pages, num_kv_heads, head_dim, page_size], see torch_ref.v_key_minor). A
    token's slot is page_id * page_size + offset; `k[layer].view(-1, num_kv_heads,
    head_dim)[slot]` is its key. The pool starts zeroed, and FP8 stores saturate
    (NaN included), so no page ever holds a NaN: kernels may read a whole last page.
    An FP8 pool also has scales: [num_layers, 2, num_kv_heads] fp32 (K, V), set by its owner
    before use, and scales_source saying where they came from. tags: [num_pages] int32, each
    page's current tag (kv_cache.page_allocator), kept up to date by the model runner.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str, parts: int = 2) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_layers, parts, num_pages, page_size, num_kv_heads, head_dim)
        # Zeroed, so every page's memory is taken now (a server's footprint does not creep up
        # as pages are first written), and GPU kernels, which load whole pages under masks,
        # never meet a stale NaN.
        self._storage = torch.zeros(shape, dtype=dtype, device=device)
        self.k = [self._storage[i, 0] for i in range(num_layers)]
        v_shape = ((num_pages, num_kv_heads, head_dim, page_size) if v_key_minor(dtype)
                   else shape[2:])
        self.v = [self._storage[i, parts - 1].view(v_shape) for i in range(num_layers)]
        self.dtype = dtype
        self.tags = torch.zeros(num_pages, dtype=torch.int32, device=device)
        self.scales: torch.Tensor | None = None
        self.scales_source: str | None = None

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def describe(self) -> dict:
        """The pool's dtype and, for FP8, where its scales came from (for /v1/models, /metrics)."""
        return {"kv_cache_dtype": str(self.dtype).removeprefix("torch."),
                "kv_scales": self.scales_source or "none (not FP8)"}

    @property
    def num_bytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()

    @staticmethod
    def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype, parts: int = 2) -> int:
        """Bytes one page takes across all layers, K and V (parts 1: MLA's latent alone)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * parts * page_size * num_kv_heads * head_dim * itemsize
