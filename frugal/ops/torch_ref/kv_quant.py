"""KV rows that carry their own scale: 8-bit values of one token and KV head, then its fp32 scale.

A cache part (K or V) in an 8-bit dtype is quantized one of two ways:
- static: one scale per layer, KV head and part, given to the ops as kv_scales ([2,
  num_kv_heads]); rows are head_dim values (ops.torch_ref.attention);
- per token and head (kv_scales None): rows are head_dim + SCALE_BYTES bytes, the values
  x / scale rounded to the dtype, then the row's scale as fp32 (little-endian bytes), scale =
  amax(|x|) over the row / the dtype's largest code. Nothing is calibrated, nothing clamps.
The row's scale lives beside its values in the page, so tags, checksums, transfers between
workers and the prefix cache carry it unchanged. A row of zeros has scale 0; NaN is stored as
0 and ±inf as the largest finite float32 (a cache never holds NaN: kernels read whole pages;
such a row may read back as ±inf, as it came).
int8 rounds half away from zero, e4m3 to nearest even.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


def row_scaled(cache: torch.Tensor, head_dim: int, kv_scales) -> bool:
    """Whether cache's rows carry their scales: an 8-bit cache [..., head_dim + 4] given no
    kv_scales."""
    return (kv_scales is None and cache.dtype in QMAX
            and cache.shape[-1] == head_dim + SCALE_BYTES)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [..., head_dim] -> rows [..., head_dim + 4] of dtype (see the module docstring)."""
    x = x.float().nan_to_num(nan=0.0)
    amax = x.abs().amax(-1, keepdim=True)
    scale = amax / QMAX[dtype]
    y = torch.where(scale > 0, x / torch.where(scale > 0, scale, 1.0), 0.0)
    y = y.clamp(-QMAX[dtype], QMAX[dtype])
    if dtype == torch.int8:
        y = (y.abs() + 0.5).floor().copysign(y)
    values = y.to(dtype).view(torch.uint8)
    scale_bytes = scale.contiguous().view(torch.uint8)
    return torch.cat([values, scale_bytes], dim=-1).view(dtype)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """Rows [..., head_dim + 4] of an 8-bit dtype -> values [..., head_dim] in fp32."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    raw = rows.view(torch.uint8)
    scale = raw[..., head_dim:].contiguous().view(torch.float32)
    return raw[..., :head_dim].view(rows.dtype).float() * scale


def scale_view(cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The fp32 scales of cache's rows ([..., head_dim + 4] 8-bit) as a view, [..., 1]."""
    return cache.view(torch.uint8)[..., head_dim:head_dim + SCALE_BYTES].view(torch.float32)
