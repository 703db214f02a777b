"""Matmuls with their neighbours fused. Same signature as frugal.ops.torch_ref.linear.

One token (decode at batch 1): a Triton GEMV that streams the weight once and fuses the rest:
the RMSNorm of x is folded in (x·g is accumulated with Σx² and the row's 1/rms multiplies the
result), as are the bias, SiLU(gate)·up (gate and up rows of one output read side by side) and
the residual add. A decode layer is then four matmul kernels and nothing between them but
attention; cuBLAS at one row also adds a split-K reduction kernel per matmul.

Quantized weights take their own kernels up to 64 tokens (the RMSNorm, if any, as its own kernel
first): INT4 (repacked by pack_weight into int4_linear's layout) and FP8 (fp8_linear); beyond,
the weight is dequantized for the step and the matmul is cuBLAS's. W8A8 FP8 weights run
fp8_w8a8 at any number of tokens (beyond 64, FP8 _scaled_mm), the RMSNorm done by the kernel
that quantizes x per token.

A decode batch (2..64 tokens): gate_up runs as a Triton tensor-core kernel with SiLU·mul as its
epilogue (one program holds all the rows; a config may split K over programs, the last one
summing: split_k); the other matmuls, and prefill, run on cuBLAS, with the RMSNorm as its own
kernel and the residual add as cuBLAS's epilogue (addmm, in place).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from frugal.ops.triton import split_k
from frugal.ops.triton.elementwise import rms_norm, silu_and_mul
from frugal.ops.triton.fp8_linear import BLOCK_K as FP8_TILE_K
from frugal.ops.triton.fp8_linear import fp8_linear
from frugal.ops.triton.fp8_w8a8 import w8a8_linear, w8a8_supported
from frugal.ops.triton.int4_linear import Int4Tiles, int4_linear, repack
from frugal.ops.triton.int4_linear import dequantize as dequantize_int4
from frugal.ops.triton.launch import enter, pdl
from frugal.ops.triton.sizes import cdiv, next_power_of_2
from frugal.ops.triton.split_k import finish, tile_range
from frugal.quant.fp8 import Fp8Weight
from frugal.quant.int4 import Int4Weight

# Rows of x up to which the GEMV runs (it reads the weight once per row beyond that), and the
# fused tensor-core kernel (one tile of rows).
GEMV_MAX_M = 1
SMALL_M_MAX = 64
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _gemv_config(n: int, k: int, gated: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, UNROLL): the best of `benchmarks/linear.py
    --sweep` on the H200 for each kind of matmul of a Llama-3.1-8B layer. (gate_up: 4 rows a
    program ran at 4.34 TB/s on one H200 but 3.6 on others, where 2 rows run at 4.29.)"""
    if gated or n * k > 6144 * 4096:
        return 2, 1024, 4, 1, 4  # gate_up, down, lm_head
    if n * k <= 4096 * 4096:
        return 4, 512, 4, 1, 4  # o
    return 16, 512, 4, 1, 2  # qkv


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, g_ptr, r_ptr, out_ptr, N, eps, K: tl.constexpr,
                 NORM: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UNROLL: tl.constexpr, PDL: tl.constexpr):
    """out[n] = epilogue(Σ_k w[n, k] · prologue(x)[k]) for one block of BLOCK_N outputs.

    x: [K]; w: [N, K] row-major ([2N, K], gate rows then up rows, if GATED); out: [N].
    UNROLL: blocks of the K loop unrolled into one step, so their loads are in flight together
    (a small matrix is latency-bound otherwise: one memory round trip per block).
    """
    enter(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    sumsq = tl.zeros([BLOCK_K], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, loop_unroll_factor=UNROLL):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if NORM:
            sumsq += x * x
            x = x * tl.load(g_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptr + rows + offs_k[None, :], mask=mask, other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        if GATED:
            w_up = tl.load(w_ptr + N * K + rows + offs_k[None, :], mask=mask, other=0.0)
            acc_up += w_up.to(tl.float32) * x[None, :]
    inv_rms = 1.0 / tl.sqrt(tl.sum(sumsq, 0) / K + eps)  # (used only if NORM)
    y = tl.sum(acc, 1)
    if NORM:
        y = y * inv_rms
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if GATED:
        up = tl.sum(acc_up, 1)
        if NORM:
            up = up * inv_rms
        if HAS_BIAS:
            up += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        y = y / (1.0 + tl.exp(-y)) * up
    if HAS_RESIDUAL:
        y += tl.load(r_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


def _small_m_config(n: int, k: int, gated: bool) -> tuple[int, ...] | None:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K]) of the tensor-core kernel for 2..64
    rows, or None where cuBLAS is as fast: `benchmarks/linear.py --tokens 64 --sweep` on the
    H200 (Llama-3.1-8B's shapes)."""
    if not gated:
        return None  # qkv, o, down: cuBLAS (the residual add is its epilogue)
    return (64, 128, 4, 4)


@triton.jit(do_not_specialize=["M"])  # (M, the rows, changes from step to step)
def _small_m_kernel(x_ptr, w_ptr, b_ptr, r_ptr, out_ptr, part_ptr, count_ptr, M, N,
                    K: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_RESIDUAL: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                    DOT_F32: tl.constexpr, PDL: tl.constexpr):
    """out[m, n] = epilogue(Σ_k x[m, k] · w[n, k]) for all M (<= BLOCK_M) rows and one block
    of BLOCK_N outputs, on tensor cores; weight layout and epilogue as in _gemv_kernel.
    SPLIT_K > 1: the K tiles shared by that many programs (grid axis 2), summed and finished
    by the last to arrive (split_k.finish: a narrow matrix, Qwen3-30B-A3B's o with 2,048
    outputs, has 32 blocks of 64 for an H100's 132 SMs).
    EVEN: N and K are multiples of the blocks (unmasked weight loads, which pipeline better).
    DOT_F32: products in fp32 (the CPU interpreter's bf16 dot is wrong)."""
    enter(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if SPLIT_K == 1:  # (bounds known at compile time, as the measured unsplit kernel had)
        first, last = 0, (K + BLOCK_K - 1) // BLOCK_K
    else:
        first, last = tile_range(tl.cdiv(K, BLOCK_K), SPLIT_K)
    offs_k = first * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for t in range(first, last):
        k_mask = (t * BLOCK_K + tl.arange(0, BLOCK_K)) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if EVEN:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            if EVEN:
                w_up = tl.load(w_ptrs + N * K)
            else:
                w_up = tl.load(w_ptrs + N * K, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            if DOT_F32:
                w_up = w_up.to(tl.float32)
            acc_up = tl.dot(x, tl.trans(w_up), acc_up)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    finish(acc, acc_up, offs_m, offs_n, m_mask, n_mask, M, N, part_ptr, count_ptr, b_ptr, r_ptr,
           out_ptr, GATED, HAS_BIAS, HAS_RESIDUAL, SPLIT_K)


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   norm: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
                   residual: torch.Tensor | None = None, config: tuple[int, ...] | None = None
                   ) -> torch.Tensor:
    """x: [M <= 64, K]; weight: [N (2N if gated), K] -> [M, N]. See linear (the RMSNorm, if
    any, runs as its own kernel first: applied inside, it would keep x's loads out of the
    software pipeline)."""
    if norm is not None:
        x = rms_norm(x, norm, eps)
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    block_n, block_k, num_warps, num_stages, *split = (
        config or _small_m_config(n, k, gated) or (64, 128, 4, 4))
    grid, split = split_k.grid(cdiv(n, block_n), 1, min(split[0] if split else 1,
                                                        cdiv(k, block_k)))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = split_k.partials(split, m, 2 * n if gated else n, x.device)
    launch_pdl = pdl(x.device)
    _small_m_kernel[grid](
        x, weight, bias, residual, out, part, split_k.counters(x.device), m, n, K=k,
        GATED=gated, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        EVEN=n % block_n == 0 and k % block_k == 0, SPLIT_K=split,
        BLOCK_M=max(16, next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_F32=_INTERPRET, PDL=launch_pdl, num_warps=num_warps, num_stages=num_stages,
        launch_pdl=launch_pdl > 0)
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         norm: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
         residual: torch.Tensor | None = None, config: tuple[int, ...] | None = None
         ) -> torch.Tensor:
    """x: [1, K]; weight: [N (2N if gated), K] -> [1, N]. See linear for the fused parts."""
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    k = weight.shape[1]
    block_n, block_k, num_warps, num_stages, unroll = config or _gemv_config(n, k, gated)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    launch_pdl = pdl(x.device)
    _gemv_kernel[(cdiv(n, block_n),)](
        x, weight, bias, norm, residual, out, n, eps, K=k,
        NORM=norm is not None, GATED=gated, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=unroll,
        PDL=launch_pdl, num_warps=num_warps, num_stages=num_stages, launch_pdl=launch_pdl > 0)
    return out


def pack_weight(weight: Int4Weight | Fp8Weight, dtype: torch.dtype) -> Int4Tiles | Fp8Weight:
    """A quantized weight (on the GPU) in the layout linear's kernels read; dtype: the
    activations'."""
    if isinstance(weight, Int4Weight):
        return repack(weight, dtype)
    if weight.block is not None and weight.block % FP8_TILE_K:
        raise ValueError(f"FP8 weights: block scales of {weight.block} on the GPU need a "
                         f"multiple of {FP8_TILE_K} (the kernel's tile)")
    return weight


def linear(x: torch.Tensor, weight: torch.Tensor | Int4Tiles | Fp8Weight,
           bias: torch.Tensor | None = None, norm: torch.Tensor | None = None, eps: float = 0.0,
           gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_tokens, in]; weight: [out, in] (or quantized, from pack_weight) ->
    [num_tokens, out], as torch_ref.linear: rms_norm(x)·norm first if norm is given,
    silu(gate)·up of the two output halves if gated, plus residual ([num_tokens, out]) last.
    The residual is handed over: the sum may be written into its storage (cuBLAS then adds in
    place instead of copying it first)."""
    m = x.shape[0]
    if isinstance(weight, (Int4Tiles, Fp8Weight)):
        int4 = isinstance(weight, Int4Tiles)
        if m > 0 and (m <= SMALL_M_MAX or (not int4 and weight.w8a8)):
            if not int4 and w8a8_supported(x, weight):  # (the norm in the quantizing kernel)
                return w8a8_linear(x.contiguous(), weight, bias, gated, residual, norm=norm,
                                   eps=eps)
            if norm is not None:
                x = rms_norm(x, norm, eps)
            return (int4_linear if int4 else fp8_linear)(x, weight, bias, gated, residual)
        # prefill: dequantized for the step, then cuBLAS
        weight = dequantize_int4(weight, x.dtype) if int4 else weight.dequantize(x.dtype)
    if 0 < m <= SMALL_M_MAX and x.dtype != torch.float32 and x.is_contiguous():
        if m <= GEMV_MAX_M:
            return gemv(x, weight, bias, norm, eps, gated, residual)
        n = weight.shape[0] // 2 if gated else weight.shape[0]
        config = _small_m_config(n, x.shape[1], gated)
        if config is not None:
            return small_m_linear(x, weight, bias, norm, eps, gated, residual, config)
    if norm is not None:
        x = rms_norm(x, norm, eps)
    if gated:
        return _add(silu_and_mul(F.linear(x, weight, bias)), residual)
    if residual is not None and bias is None:
        return torch.addmm(residual, x, weight.t(), out=residual)
    return _add(F.linear(x, weight, bias), residual)


def _add(y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return y if residual is None else residual + y
