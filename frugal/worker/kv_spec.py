"""The shape of one worker's KV cache, stated once: what a page holds and what it costs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from frugal.config import KV_DTYPES, KV_FORMATS, CacheConfig
from frugal.layers.attention import backend_for
from frugal.model_config import ModelConfig
from frugal.ops.torch_ref.kv_quant import SCALE_BYTES
from frugal.parallel import SINGLE, Parallel
from frugal.worker.kv_pool import KVPool


@dataclass(frozen=True)
class KVSpec:
    """A page: num_layers x parts x [page_size, num_kv_heads, width] of dtype.

    parts: 2 (K and V) or 1 (MLA's latent rows, DSA's index key after it); num_kv_heads: this
    rank's (MLA: its one latent head, replicated on every rank); width: values a token and head
    (bytes for FP8, whose DSA rows carry the index key's scale too: ModelConfig.cache_width).
    name: the kv_cache_dtype it stands for. row_scaled: 8-bit rows with a scale each
    (ops.torch_ref.kv_quant: head_dim + 4 wide). k_split (parts 1 of a model with K and V):
    (K's dtype, head_dim), each row being K's head_dim values in that dtype, then V's row."""

    num_layers: int
    parts: int
    page_size: int
    num_kv_heads: int
    width: int
    dtype: torch.dtype
    name: str = "auto"
    row_scaled: bool = False
    k_split: tuple[torch.dtype, int] | None = None

    @classmethod
    def of(cls, mc: ModelConfig, cache: CacheConfig, activation_dtype: torch.dtype,
           parallel: Parallel = SINGLE) -> KVSpec:
        """The cache a config asks for ('auto' dtype: the activations')."""
        name = cache.kv_cache_dtype
        dtype = activation_dtype if name == "auto" else KV_DTYPES[name]
        name = name if name in KV_FORMATS else "auto"  # (an unquantized pool: named by dtype)
        layout = backend_for(mc).kv_layout(mc, parallel, cache.fp8)  # (its attention's rows)
        spec = cls(mc.num_layers, layout.parts, cache.page_size, layout.num_kv_heads,
                   layout.width, dtype, name)
        if name not in KV_FORMATS or not KV_FORMATS[name][2]:
            return spec
        if mc.mla is not None:  # one row: the latent's 8-bit values, its scale, the index key
            if KV_FORMATS[name][0] is None or (mc.dsa is not None and dtype != torch.float8_e4m3fn):
                raise ValueError(f"kv_cache_dtype: {name} is not available for "
                                 f"{'DSA' if mc.dsa else 'MLA'} models (auto, fp8_e4m3, "
                                 f"fp8_per_token_head{'' if mc.dsa else ', int8_per_token_head'})")
            return dataclasses.replace(spec, width=mc.cache_width(True, row_scaled=True),
                                       row_scaled=True)
        d = layout.width
        if d % SCALE_BYTES:
            raise ValueError(f"kv_cache_dtype: {name} needs a head_dim divisible by "
                             f"{SCALE_BYTES}, the model has {d}")
        k_dtype = KV_FORMATS[name][0]
        if k_dtype is not None:  # K and V rows alike
            return dataclasses.replace(spec, width=d + SCALE_BYTES, row_scaled=True)
        k_bytes = d * activation_dtype.itemsize  # one row: K in the activation dtype, V's row
        return dataclasses.replace(spec, parts=1, width=k_bytes + d + SCALE_BYTES,
                                   row_scaled=True, k_split=(activation_dtype, d))

    def unquantized(self, mc: ModelConfig, dtype: torch.dtype) -> KVSpec:
        """The same cache in dtype (no 8-bit row extras): what FP8 scales are calibrated on,
        and the reference of the start-up check (worker.kv_check)."""
        return dataclasses.replace(self, width=mc.cache_width(False), dtype=dtype,
                                   parts=2 if self.k_split else self.parts, name="auto",
                                   row_scaled=False, k_split=None)

    @property
    def page_bytes(self) -> int:
        return KVPool.page_bytes(self.num_layers, self.page_size, self.num_kv_heads, self.width,
                                 self.dtype, self.parts)

    def pool(self, num_pages: int, device: str, shareable: bool = False) -> KVPool:
        return KVPool(self.num_layers, num_pages, self.page_size, self.num_kv_heads, self.width,
                      self.dtype, device, self.parts,
                      None if self.name == "auto" else self.name, self.row_scaled,
                      self.k_split, shareable)
