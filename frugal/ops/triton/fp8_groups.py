"""Activations rounded to FP8 (e4m3) in registers, one scale per row and GROUP inputs: the
inputs of W8A8 experts (quant.experts.Fp8Experts.w8a8), as quant.fp8.quantize_groups rounds
them.

The rounding is fp32 arithmetic, not a cast: adding and taking away 1.5 · 2^(e + 20) (e: the
value's binary exponent, at least -6, e4m3's smallest normal) leaves the value on e4m3's grid
(3 mantissa bits; subnormals 2^-9 apart), ties to even, as any IEEE fp32 addition rounds.
The result is exact in e4m3 (a cast to it then changes nothing) and the same in Triton's CPU
interpreter, whose casts to e4m3 round some ties and subnormals otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from frugal.ops.triton.sizes import cdiv
from frugal.quant.fp8 import FP8

GROUP = 128  # inputs a scale covers (DeepSeek's FP8 activations: 1 × 128)


@triton.jit
def round_e4m3(v):
    """v (fp32, |v| ≤ 448) to the nearest e4m3 value, as fp32."""
    e = tl.maximum((v.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)  # (biased; 121: 2^-6)
    c = ((e + 20) << 23).to(tl.float32, bitcast=True) * 1.5
    return (v + c) - c


@triton.jit
def quantize_group(a):
    """a [ROWS, GROUP] fp32 -> (q [ROWS, GROUP] e4m3 values as fp32, s [ROWS] fp32), a ≈ q · s:
    s = max(max|a|, 1e-12) / 448 per row, q = round_e4m3(clamp(a · (1 / s), ±448)), as
    quant.fp8.quantize_rows rounds a row (a row holding NaN or inf: s NaN, so its products are)."""
    s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(a), axis=1), 1e-12), 448.0)
    s += tl.sum(a * 0.0, axis=1)  # (a NaN or inf input: NaN, which max and clamp would drop)
    q = round_e4m3(tl.clamp(a * tl.math.div_rn(1.0, s)[:, None], -448.0, 448.0))
    return q, s


@triton.jit
def w8a8_step(q, s_a, w_ptr, s_ptr, expert, k0, offs_k, k_ok, offs_n, n_ok, swe, swn, swk,
               sse, ssn, ssk, acc, S_BN: tl.constexpr, S_BK: tl.constexpr,
               F32_DOT: tl.constexpr):
    """acc + (q · w) · s_a · s_w over one group of 128 inputs: q [BLOCK_M, 128] e4m3 codes (or
    their values in fp32) and s_a [BLOCK_M] their scales; w the expert's e4m3 tile as stored,
    s_w [BLOCK_N] its scales over these inputs (a block's or a channel's). Under 64 rows the
    product is taken transposed, the weights' outputs on the MMA's 64-row side."""
    w = tl.load(w_ptr + expert * swe + offs_n[None, :] * swn + offs_k[:, None] * swk,
                mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    s_w = tl.load(s_ptr + expert * sse + (offs_n // S_BN) * ssn + (k0 // S_BK) * ssk,
                  mask=n_ok, other=0.0)
    if F32_DOT:
        part = tl.dot(q.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    elif q.shape[0] >= 64:
        part = tl.dot(q.to(tl.float8e4nv), w)
    else:
        part = tl.trans(tl.dot(tl.trans(w), tl.trans(q.to(tl.float8e4nv))))
    return acc + part * (s_a[:, None] * s_w[None, :])


@triton.jit
def round_inputs(a, BLOCK_K: tl.constexpr):
    """a [BLOCK_K] fp32 (BLOCK_K a multiple of GROUP, starting at a group) as q · s per
    group: what a W8A8 matmul multiplies."""
    q, s = quantize_group(tl.reshape(a, (BLOCK_K // 128, 128)))
    return tl.reshape(q * s[:, None], (BLOCK_K,))


@triton.jit(do_not_specialize=["M"])
def _quantize(x_ptr, q_ptr, s_ptr, M, K, sxm, sqm, ssm, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    ok = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * sxm + cols[None, :], mask=ok, other=0.0)
    q, s = quantize_group(x.to(tl.float32))
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * sqm + cols[None, :],
             q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + rows.to(tl.int64) * ssm + tl.program_id(1), s, mask=rows < M)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scales [M, ceil(K / GROUP)] fp32) as
    quant.fp8.quantize_groups: for the products of many rows, whose blocks would otherwise
    each round the same rows again. (The codes lie on e4m3's grid before they are stored: the
    interpreter's stores keep them.)"""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    s = torch.empty(m, cdiv(k, GROUP), dtype=torch.float32, device=x.device)
    if m:
        _quantize[(cdiv(m, 16), cdiv(k, GROUP))](x, q, s, m, k, x.stride(0), q.stride(0),
                                                 s.stride(0), ROWS=16, num_warps=4)
    return q, s
