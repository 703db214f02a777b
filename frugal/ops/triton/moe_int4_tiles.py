"""INT4 experts in int4_linear's layout, stacked: what moe_int4_wgmma's kernel reads.

Int4ExpertTiles holds every expert's matrix as int4_linear.repack lays out one (rows in blocks
of 64, 128-input tiles, the words of a tile in tensor-core order; (scale, min) pairs in the
activations' dtype; the scales alone, [E, Kp / group, R], where every expert is centered),
stacked on a leading expert dim: words [E, R / 64, Kp / 128, 64, 16] int32, params
[E, Kp / group, R, 2] (pairs) or [E, Kp / group, R] (scales). pack_experts repacks INT4
experts into it at load time (in place of quant.experts.Int4Experts on a Hopper GPU, unless
FRUGAL_INT4_MOE_WGMMA=0); `dequantize` widens a chunk of them for prompts (moe_dense).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from frugal.ops.triton.int4_linear import _OFFSET, TILE_K, _dequantize_kernel, repack, uncentered
from frugal.quant.experts import Int4Experts


@dataclass
class Int4ExpertTiles:
    """Stacked experts [E, R, K] in int4_linear's layout (see the module docstring)."""

    words: torch.Tensor
    params: torch.Tensor
    in_features: int
    group: int
    centered: bool

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.params.shape[0], self.params.shape[2], self.in_features

    @property
    def padded_k(self) -> int:  # Kp
        return self.words.shape[2] * TILE_K


def repack_experts(w: Int4Experts, dtype: torch.dtype) -> Int4ExpertTiles:
    """Every expert of w in the kernel's layout, scales and mins in dtype (the activations'):
    each repacked into its place in the stack (beside w, one expert's copy at a time: a layer of
    Kimi K2's 384 experts is ~9.5 GB)."""
    first = repack(w.expert(0), dtype)
    words = first.words.new_empty((w.shape[0], *first.words.shape))
    params = first.params.new_empty((w.shape[0], *first.params.shape))
    centered = first.centered
    for e in range(w.shape[0]):
        tiles = first if e == 0 else repack(w.expert(e), dtype)
        if centered and not tiles.centered:  # (one expert's mins are not -8 · scale: pairs)
            params, centered = torch.stack([params, -8 * params], -1), False
        words[e] = tiles.words
        params[e] = tiles.params if centered or not tiles.centered else uncentered(tiles).params
    return Int4ExpertTiles(words, params, first.in_features, first.group, centered)


@functools.cache
def _hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def pack_experts(w, dtype: torch.dtype):
    """Routed experts as the kernels read them: INT4 experts on a Hopper GPU repacked into this
    layout (in place of the packed words: fused_moe then runs them on moe_int4_wgmma at every
    size, and dequantizes them at prompt sizes; FRUGAL_INT4_MOE_WGMMA=0 keeps the packed words
    for moe_gemv and moe_int4); anything else unchanged."""
    if (os.environ.get("FRUGAL_INT4_MOE_WGMMA") == "0" or not isinstance(w, Int4Experts)
            or not _hopper(w.packed.device) or dtype not in _OFFSET or w.shape[2] % 2):
        return w
    group = w.group_size  # (int4_linear.repack's groups: 32, 64 or multiples of 128)
    if group < 32 or (TILE_K % group and group % TILE_K):
        return w
    return repack_experts(w, dtype)


def dequantize(w: Int4ExpertTiles, first: int, out: torch.Tensor) -> torch.Tensor:
    """Experts first .. first + len(out) - 1 of w into out [count, R, K] (contiguous), as
    int4_linear.dequantize computes each; returns out."""
    count, rows, k = out.shape
    if (rows, k) != w.shape[1:] or not 0 <= first <= w.shape[0] - count or not out.is_contiguous():
        raise ValueError(f"moe_int4_tiles.dequantize: experts {first}+{count} of {w.shape} "
                         f"into {tuple(out.shape)}")
    _dequantize_kernel[(triton.cdiv(rows, 64), w.words.shape[2], count)](
        w.words, w.params, out, rows, k, first, w.words.stride(0), w.params.stride(0),
        out.stride(0), KP=w.padded_k, GROUP=w.group, CENTERED=w.centered, BLOCK_N=64)
    return out
