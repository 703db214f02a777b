"""MLA's latent rows and DSA's index keys into the paged cache, one program a token: no mask of the
valid slots gathered on the host (a negative slot stores nothing), so a decode step needs no
host sync here and fits in a CUDA graph. Same signatures as torch_ref.mla.store_latent and
torch_ref.dsa.store_index_key."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from frugal.ops.torch_ref.kv_quant import QMAX, row_scaled, scale_view
from frugal.ops.triton.kv_store import finite_abs, store_quantized
from frugal.ops.triton.launch import enter, pdl
from frugal.ops.triton.sizes import next_power_of_2


@triton.jit
def _store_kernel(x_ptr, slot_ptr, cache_ptr, scale_ptr, row_scale_ptr, x_stride, cache_row,
                  scale_row, WIDTH: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr,
                  QMAX: tl.constexpr, PDL: tl.constexpr):
    """Token t's row x[t, :WIDTH] to cache row slot[t] (cache_row elements apart), as
    kv_store.store_quantized writes it: MODE 0 cast to the cache's dtype; 1 static FP8 over
    scale_ptr[0]; 2 over the row's own scale (amax / QMAX, stored at row_scale_ptr + slot *
    scale_row)."""
    enter(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, BLOCK)
        ok = d < WIDTH
        x = tl.load(x_ptr + t * x_stride + d, mask=ok, other=0.0)
        dst = cache_ptr + slot * cache_row + d
        scale = 1.0
        if MODE == 1:
            scale = tl.load(scale_ptr)
        elif MODE == 2:  # (div_rn: IEEE division, torch_ref's bits)
            scale = tl.math.div_rn(tl.max(finite_abs(x), 0), QMAX)
            tl.store(row_scale_ptr + slot * scale_row, scale)
        store_quantized(dst, x, scale, ok, MODE == 1, MODE == 2)


def _launch(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, mode: int,
            scale: torch.Tensor | None, row_scales: torch.Tensor | None) -> None:
    """x: [num_tokens, width] (rows may be strided); cache [num_pages, page_size, 1, >= width]."""
    if x.shape[0] == 0:
        return
    x = x if x.stride(-1) == 1 else x.contiguous()
    width = x.shape[-1]
    launch_pdl = pdl(x.device)
    _store_kernel[(x.shape[0],)](
        x, slot_mapping, cache, cache if scale is None else scale,
        cache if row_scales is None else row_scales, x.stride(0), cache.stride(1),
        0 if row_scales is None else row_scales.stride(1), WIDTH=width,
        BLOCK=next_power_of_2(width), MODE=mode,
        QMAX=QMAX.get(cache.dtype, 448.0), PDL=launch_pdl, launch_pdl=launch_pdl > 0)


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: torch.Tensor | None = None) -> None:
    """See torch_ref.mla.store_latent: latent [num_tokens, 1, width]."""
    width = latent.shape[-1]
    if row_scaled(cache, width, kv_scales):
        _launch(latent[:, 0], cache, slot_mapping, 2, None, scale_view(cache, width))
    elif cache.element_size() == 1:
        _launch(latent[:, 0], cache, slot_mapping, 1, kv_scales[0], None)
    else:
        _launch(latent[:, 0], cache, slot_mapping, 0, None, None)


def store_index_key(key: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """See torch_ref.dsa.store_index_key: key [num_tokens, dim]; an FP8 cache's row is the key
    / its own scale, the fp32 scale (ops.torch_ref.kv_quant's rows), then 12 bytes of zeros."""
    if cache.element_size() != 1:
        _launch(key, cache, slot_mapping, 0, None, None)
        return
    dim = key.shape[-1]  # (the padding keeps the zeros the pool started with)
    _launch(key, cache, slot_mapping, 2, None, scale_view(cache, dim))
