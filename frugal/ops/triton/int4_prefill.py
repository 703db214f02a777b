"""INT4 weights on FP8 tensor cores (W4A8), for prefill: many rows, where the matmul is bound by
compute and bf16 tensor cores run at half FP8's rate.

Σ_k x_k w_k with w = u · scale + min (code u in [0, 15]) is, per group,
    scale · Σ x (u - 8) + (min + 8 · scale) · Σ x,
and u - 8 in [-8, 7] is exact in e4m3. So for groups of 128 inputs (or multiples):
  - `quantize_tiles` rounds x to e4m3 per row and 128-input tile (x ≈ s · q, s = the tile's
    amax / 448; quant.fp8.round_tiles is its twin) and sums each tile (Σ s · q);
  - `codes` writes the weight's u - 8 as e4m3 [N, Kp] (int4_linear's words, unpacked; the
    step's only copy of the weight, freed after the matmul);
  - `torch._scaled_mm` multiplies them with block-wise scales, one per row and tile of x and
    one per output and tile of the weight (the group scales): FP8 cuBLAS, scales applied in
    fp32 per tile, never folded into the codes;
  - unless every min is -8 · scale (symmetric codes), the tile sums times min + 8 · scale
    are added (an [M, Kp / 128] × [Kp / 128, N] matmul).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from frugal.quant.fp8 import FP8

TILE_K = 128


@triton.jit(do_not_specialize=["M"])
def _quantize_kernel(x_ptr, q_ptr, s_ptr, sum_ptr, M, K, KP, ROWS: tl.constexpr):
    """Rows [ROWS] of one 128-input tile: q = x / s in e4m3, s = max(amax, 1e-12) / 448 (stored
    tile-major: s_ptr [Kp / 128, rows]), and Σ s · q; rows M.. (padding) get codes 0."""
    offs_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    tile = tl.program_id(1)
    offs_k = tile * 128 + tl.arange(0, 128)
    x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :],
                mask=(offs_m < M)[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12), 448.0)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -448.0, 448.0).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + offs_m.to(tl.int64)[:, None] * KP + offs_k[None, :], q)
    tl.store(s_ptr + tile * (tl.num_programs(0) * ROWS) + offs_m, scale)
    tl.store(sum_ptr + offs_m * (KP // 128) + tile, tl.sum(q.to(tl.float32), axis=1) * scale)


def quantize_tiles(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M16, Kp] e4m3, scales [M16, Kp / 128] fp32 (a view of [Kp / 128, M16],
    the layout cuBLAS's block scales take), sums [M16, Kp / 128] fp32: each tile's Σ s · q);
    M16: M rounded up to 16 (cuBLAS's block-scaled matmul wants whole 16-row blocks), the
    padding's rows and inputs 0."""
    m, k = x.shape
    rows, tiles = triton.cdiv(m, 16) * 16, triton.cdiv(k, TILE_K)
    q = torch.empty(rows, tiles * TILE_K, dtype=FP8, device=x.device)
    scales = torch.empty(tiles, rows, dtype=torch.float32, device=x.device)
    sums = torch.empty(rows, tiles, dtype=torch.float32, device=x.device)
    _quantize_kernel[(rows // 16, tiles)](x, q, scales, sums, m, k, tiles * TILE_K, ROWS=16)
    return q, scales.t(), sums


@triton.jit
def _codes_kernel(w_ptr, out_ptr, N, KP, BLOCK_N: tl.constexpr):
    """out[n, k] = u - 8 in e4m3 for one block of rows and one 128-input tile (int4_linear's
    words [BN, 4 (t), 4 (q)]: nibble (2 a + b) + 4 c of word 4 t + q is input
    32 q + 16 a + 8 b + 2 t + c)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    tile = tl.program_id(1)
    words = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * (KP // 8) + tile * 16
                    + tl.arange(0, 16)[None, :], mask=n_mask[:, None], other=0)
    words = words.reshape(BLOCK_N, 4, 4)
    low = tl.join(tl.join(words & 0xF, (words >> 4) & 0xF),
                  tl.join((words >> 8) & 0xF, (words >> 12) & 0xF))  # [BN, t, q, b, a]
    high = words >> 16
    high = tl.join(tl.join(high & 0xF, (high >> 4) & 0xF),
                   tl.join((high >> 8) & 0xF, (high >> 12) & 0xF))
    codes = tl.join(low, high).permute(0, 2, 4, 3, 1, 5).reshape(BLOCK_N, 128)  # q, a, b, t, c
    offs_k = tile * 128 + tl.arange(0, 128)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * KP + offs_k[None, :],
             (codes - 8).to(tl.float32).to(out_ptr.dtype.element_ty), mask=n_mask[:, None])


def codes(words: torch.Tensor) -> torch.Tensor:
    """int4_linear's words [N, Kp / 8] -> the codes minus 8, [N, Kp] e4m3 (exact)."""
    n, kp = words.shape[0], words.shape[1] * 8
    out = torch.empty(n, kp, dtype=FP8, device=words.device)
    _codes_kernel[(triton.cdiv(n, 64), kp // TILE_K)](words, out, n, kp, BLOCK_N=64)
    return out


def w4a8_matmul(x: torch.Tensor, words: torch.Tensor, params: torch.Tensor, group: int,
                centered: bool) -> torch.Tensor:
    """x [M, K] (bf16 or fp16) @ wᵀ -> [M, N] in x's dtype, for int4_linear's words [N, Kp / 8]
    and params [Kp / group, N, 2] ((scale, min) per group; group a multiple of 128). centered:
    min = -8 · scale in every group (the mins' term is skipped)."""
    q, scales, sums = quantize_tiles(x)
    repeat = group // TILE_K
    w_scales = params[..., 0].float().repeat_interleave(repeat, 0)  # [Kp / 128, N]
    y = torch._scaled_mm(q, codes(words).t(), scale_a=scales, scale_b=w_scales,
                         out_dtype=torch.bfloat16)[:x.shape[0]]
    if not centered:
        lows = (params[..., 1].float() + 8 * params[..., 0].float()).repeat_interleave(repeat, 0)
        y = torch.addmm(y.float(), sums[:x.shape[0]], lows).to(torch.bfloat16)
    return y.to(x.dtype)
