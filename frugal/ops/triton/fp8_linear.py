"""FP8 (e4m3) weight matmuls: W8A8 (fp8_w8a8) and W8A16 with the weight widened in registers.

W8A8 (an Fp8Weight with w8a8 and per-channel scales, bf16/fp16 activations): x is quantized
per token and multiplied on FP8 tensor cores, by fp8_w8a8's split-K kernel up to 64 rows and
torch._scaled_mm beyond.

W8A16 (weights without w8a8; w8a8 ones with block scales, fp32 activations or in the CPU
interpreter, then x rounded per token first): the weight is used as stored ([N, K]
float8_e4m3fn, row-major, and its float32 scales). A tile of 128 inputs is loaded K-contiguous,
as the tensor cores' B operand wants it, and widened to fp16 (one instruction per two values,
exact); bf16 activations go to fp16 with saturation at ±65504 (fp16's range; activations
beyond it are clipped). Products accumulate in fp32; per-channel scales multiply the result
once, 128×128-block scales each tile's partial product. fp32 activations (and the CPU
interpreter) multiply in exact fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from frugal.ops.triton.fp8_w8a8 import w8a8_linear, w8a8_supported
from frugal.ops.triton.launch import enter, pdl
from frugal.ops.triton.sizes import cdiv
from frugal.ops.triton.split_k import counters, finish, grid, load_tile, partials, tile_range
from frugal.quant.fp8 import Fp8Weight, round_rows

BLOCK_K = 128
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["M"])  # (M, the rows, changes from step to step)
def _fp8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, r_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                s_stride,
                SCALE_BLOCK: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
                PDL: tl.constexpr):
    """out[m, n] = epilogue(Σ_k x[m, k] · w[n, k] · scale) for a [BLOCK_M, BLOCK_N] block over
    this program's share of the 128-input tiles (SPLIT_K > 1: reduced in split_k.finish).
    SCALE_BLOCK: 0 for per-channel scales (s_ptr: [rows]),
    else the block size of scales [rows / SCALE_BLOCK, K / SCALE_BLOCK] (row stride
    s_stride). GATED: w holds 2N rows (gate, then up); the output is silu(gate) · up."""
    enter(PDL)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, 128)
    first, last = tile_range(tl.cdiv(K, 128), SPLIT_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]  # [128, BLOCK_N]
    x_ptrs = x_ptr + offs_m[:, None] * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for t in tl.range(first, last):
        k0 = t * 128
        k_mask = (k0 + offs_k) < K
        x = load_tile(x_ptrs + k0, m_mask[:, None], k_mask[None, :], EVEN_K)
        w = load_tile(w_ptrs + k0, n_mask[None, :], k_mask[:, None], EVEN_K)
        x = _widen_x(x, DOT_F32)
        part = tl.dot(x, _widen_w(w, DOT_F32), input_precision="ieee" if DOT_F32 else "tf32")
        if SCALE_BLOCK:
            s = tl.load(s_ptr + (offs_n // SCALE_BLOCK) * s_stride + k0 // SCALE_BLOCK,
                        mask=n_mask, other=0.0)
            acc += part * s[None, :]
        else:
            acc += part
        if GATED:
            w_up = load_tile(w_ptrs + N * K + k0, n_mask[None, :], k_mask[:, None], EVEN_K)
            part = tl.dot(x, _widen_w(w_up, DOT_F32),
                          input_precision="ieee" if DOT_F32 else "tf32")
            if SCALE_BLOCK:
                s = tl.load(s_ptr + ((offs_n + N) // SCALE_BLOCK) * s_stride + k0 // SCALE_BLOCK,
                            mask=n_mask, other=0.0)
                acc_up += part * s[None, :]
            else:
                acc_up += part
    if not SCALE_BLOCK:
        acc *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(s_ptr + N + offs_n, mask=n_mask, other=0.0)[None, :]
    finish(acc, acc_up, offs_m, offs_n, m_mask, n_mask, M, N, part_ptr, count_ptr, b_ptr, r_ptr,
           out_ptr, GATED, HAS_BIAS, HAS_RESIDUAL, SPLIT_K)


@triton.jit
def _widen_x(x, DOT_F32: tl.constexpr):
    if DOT_F32:
        y = x.to(tl.float32)
    else:
        y = tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return y


@triton.jit
def _widen_w(w, DOT_F32: tl.constexpr):
    if DOT_F32:
        y = w.to(tl.float32)
    else:
        y = w.to(tl.float16)
    return y


def _config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, SPLIT_K, num_warps, num_stages) for x [m, k], a weight of n rows. Up
    to 16 rows, near the best of `benchmarks/quant_linear.py --sweep-fp8` on the H200
    (Llama-3.1-8B shapes): blocks of 128 outputs, the inputs split into the most parts that
    keep the programs within about two per SM (264) and two tiles each."""
    if m > 16:
        return (32 if m <= 32 else 64), 64, 2, 4, 3
    blocks = cdiv(n, 128)
    split = 1
    while blocks * split * 2 <= 264 and cdiv(k, BLOCK_K) >= 4 * split:
        split *= 2
    return 16, 128, split, 4, 3


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
               gated: bool = False, residual: torch.Tensor | None = None,
               config: tuple[int, ...] | None = None) -> torch.Tensor:
    """x: [M, K] (bf16, fp16 or fp32); w: [N (2N if gated), K] -> [M, N] in x's dtype: x @ wᵀ
    (+ bias), silu(gate) · up if gated, + residual. As ops.linear without the norm. A w8a8
    weight quantizes x per token (fp8_w8a8 where w8a8_supported, else x is rounded as W8A8
    would see it and the W8A16 kernel runs)."""
    x = x.contiguous()
    m, k = x.shape
    rows = w.shape[0]
    n = rows // 2 if gated else rows
    if k != w.shape[1]:
        raise ValueError(f"fp8_linear: x has {k} inputs, the weight {w.shape[1]}")
    if w.w8a8:
        if w8a8_supported(x, w):
            return w8a8_linear(x, w, bias, gated, residual)
        x = round_rows(x)  # (elsewhere: x rounded as W8A8 would see it)
    if w.block is not None and (w.block % BLOCK_K or (gated and n % w.block)):
        raise ValueError(f"fp8_linear: block scales of {w.block} need a multiple of {BLOCK_K} "
                         "(and gate/up halves in whole blocks)")
    block_m, block_n, split, num_warps, num_stages = config or _config(m, n, k)
    launch, split = grid(cdiv(n, block_n), cdiv(m, block_m), split)
    f32 = x.dtype == torch.float32 or _INTERPRET
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    launch_pdl = pdl(x.device)
    _fp8_kernel[launch](
        x, w.data, w.scales, bias, residual, out, partials(split, m, rows, x.device),
        counters(x.device), m, n, k, w.scales.stride(0), SCALE_BLOCK=w.block or 0, GATED=gated,
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, SPLIT_K=split, EVEN_K=k % BLOCK_K == 0, DOT_F32=f32, PDL=launch_pdl,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=launch_pdl > 0)
    return out

