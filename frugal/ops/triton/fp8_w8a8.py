"""W8A8 FP8 matmuls on the GPU: activations quantized dynamically per token, per-channel FP8
weights, products on FP8 tensor cores.

One kernel turns x into e4m3 with one scale per row (its amax / 448, as
quant.fp8.quantize_rows), rows padded to 16; where an RMSNorm comes first (qkv, gate_up), the
same kernel normalizes the row before quantizing it. Then, up to SMALL_M rows (decode batches),
`_w8a8` multiplies: the product is computed transposed, outᵀ = W · xᵀ, so the weight's rows
fill the FP8 MMA's 64-row side and x's rows its narrow one; both operands are read as stored
(K-contiguous, as FP8 MMAs want them); each 128-input tile's products are added into the fp32
sums apart (Hopper's FP8 MMAs add with about 14 bits: carried over all of K, sums of one sign
were off by 6 % RMS at K = 14336), and both scale vectors multiply once at the end; the inputs
are split across programs (split-K, reduced in the kernel: split_k.finish) so that a few rows
still keep every SM streaming weights.
Beyond SMALL_M rows (prefill) torch._scaled_mm multiplies with its row-wise scales (CUTLASS).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from frugal.ops.triton.elementwise import silu_and_mul
from frugal.ops.triton.launch import enter, pdl
from frugal.ops.triton.sizes import cdiv, next_power_of_2
from frugal.ops.triton.split_k import counters, finish, grid, load_tile, partials, tile_range
from frugal.quant.fp8 import FP8, Fp8Weight

SMALL_M = 64  # most rows _w8a8 takes (one block of rows); beyond, _scaled_mm
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["M"])  # (M, the rows, changes from step to step)
def _w8a8(q_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, r_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
          GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
          DOT_F32: tl.constexpr, PDL: tl.constexpr):
    """out[m, n] = epilogue(xs[m] · ws[n] · Σ_k q[m, k] · w[n, k]) for all M (<= BLOCK_M) rows
    and one block of BLOCK_N outputs over this program's share of the 128-input tiles.
    q: [M, K] e4m3 and xs: [M] fp32, x's codes and row scales; w: [N (2N if GATED: gate rows,
    then up), K] e4m3 and ws: [N (2N)] its channel scales. DOT_F32: the e4m3 values multiplied
    in fp32 (the CPU interpreter)."""
    enter(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, 128)
    first, last = tile_range(tl.cdiv(K, 128), SPLIT_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]  # [BLOCK_N, 128]
    q_ptrs = q_ptr + offs_m[:, None] * K + offs_k[None, :]  # [BLOCK_M, 128]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for t in tl.range(first, last):
        k0 = t * 128
        k_mask = (k0 + offs_k)[None, :] < K
        q = load_tile(q_ptrs + k0, m_mask[:, None], k_mask, EVEN_K)
        w = load_tile(w_ptrs + k0, n_mask[:, None], k_mask, EVEN_K)
        qt = tl.trans(q)  # [128, BLOCK_M]
        if DOT_F32:
            qt = qt.to(tl.float32)
        acc = _dot(w, qt, acc, DOT_F32)
        if GATED:
            w_up = load_tile(w_ptrs + N * K + k0, n_mask[:, None], k_mask, EVEN_K)
            acc_up = _dot(w_up, qt, acc_up, DOT_F32)
    xs = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
    acc *= tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)[:, None] * xs
    if GATED:
        acc_up *= tl.load(ws_ptr + N + offs_n, mask=n_mask, other=0.0)[:, None] * xs
    finish(tl.trans(acc), tl.trans(acc_up), offs_m, offs_n, m_mask, n_mask, M, N, part_ptr,
           count_ptr, b_ptr, r_ptr, out_ptr, GATED, HAS_BIAS, HAS_RESIDUAL, SPLIT_K)


@triton.jit
def _dot(w, qt, acc, DOT_F32: tl.constexpr):
    """acc + w [BN, 128] e4m3 · qt [128, BM] (e4m3, or its values in fp32) -> [BN, BM] fp32,
    the tile's products summed by the MMAs and added to acc in fp32."""
    if DOT_F32:
        y = tl.dot(w.to(tl.float32), qt, acc, input_precision="ieee")
    else:
        y = tl.dot(w, qt, acc, max_num_imprecise_acc=128)
    return y


def _config(m: int, n: int, k: int, gated: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, SPLIT_K, num_warps, num_stages) for x [m, k] and n outputs (2n rows if
    gated), near the best of `benchmarks/quant_linear.py --sweep-w8a8` on the H200 at 32 and
    64 rows (Llama-3.1-8B shapes): blocks of 64 outputs (one warpgroup), the inputs split while
    the blocks (a gated one counting twice: it streams twice the rows) times the parts stay
    within two an SM (264), 4 tiles a part at least. (m: the same at every row count.)"""
    blocks, tiles = cdiv(n, 64) * (2 if gated else 1), cdiv(k, 128)
    split = 1
    while blocks * split * 2 <= 264 and tiles >= 8 * split:
        split *= 2
    return 64, split, 4, 4


@triton.jit(do_not_specialize=["M"])
def _quantize_rows_kernel(x_ptr, g_ptr, q_ptr, s_ptr, M, K, eps, NORM: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row m of q = y[m] · (1 / s[m]) saturated to e4m3, s[m] = max(max|y[m]|, 1e-12) / 448, as
    quant.fp8.quantize_rows; rows M.. (padding) get codes 0. y = x, or with NORM its RMSNorm
    times g, rounded to x's dtype as elementwise.rms_norm returns it (the same codes as that
    kernel and then this one)."""
    enter(PDL)
    m = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + m.to(tl.int64) * K + offs, mask=mask & (m < M), other=0.0)
    y = x.to(tl.float32)
    if NORM:
        inv = 1.0 / tl.sqrt(tl.sum(y * y, 0) / K + eps)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (g * (y * inv).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12), 448.0)  # (FP8_MAX)
    # (one reciprocal a row: a division per element made the kernel compute-bound)
    q = tl.clamp(y * tl.math.div_rn(1.0, scale), -448.0, 448.0)
    tl.store(q_ptr + m.to(tl.int64) * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + m, scale)


def quantize_rows_padded(x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M16, K] e4m3, scales [M16, 1] fp32), M16 = M rounded up to 16; with
    norm ([K]), rms_norm(x, norm, eps) is what is quantized (one kernel, one pass over x)."""
    m, k = x.shape
    rows = -(-m // 16) * 16
    q = torch.empty(rows, k, dtype=FP8, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block = next_power_of_2(k)
    launch_pdl = pdl(x.device)
    _quantize_rows_kernel[(rows,)](x, norm, q, scales, m, k, eps, NORM=norm is not None,
                                   BLOCK=block, PDL=launch_pdl,
                                   num_warps=8 if block >= 8192 else 4,
                                   launch_pdl=launch_pdl > 0)
    return q, scales


def w8a8_supported(x: torch.Tensor, w: Fp8Weight) -> bool:
    """Whether x @ wᵀ runs here: a w8a8 weight, and a device, dtype and shapes these kernels
    take (per-channel scales; K and N multiples of 16, as _scaled_mm wants)."""
    n, k = w.shape
    return (w.w8a8 and w.block is None and x.device.type == "cuda"
            and not _INTERPRET and x.dtype in (torch.bfloat16, torch.float16)
            and k % 16 == 0 and n % 16 == 0)


def w8a8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
                gated: bool = False, residual: torch.Tensor | None = None,
                config: tuple[int, int, int, int] | None = None,
                norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """x: [M, K] bf16/fp16 (w8a8_supported); w: [N (2N if gated), K] -> [M, N] in x's dtype,
    x (or rms_norm(x, norm, eps), normalized by the quantizing kernel) rounded to FP8 per
    token: x @ wᵀ (+ bias), silu(gate) · up if gated, + residual."""
    m, k = x.shape
    if k != w.shape[1]:
        raise ValueError(f"w8a8_linear: x has {k} inputs, the weight {w.shape[1]}")
    q, scales = quantize_rows_padded(x.contiguous(), norm, eps)
    if m <= SMALL_M:
        return multiply(q, scales, m, w, x.dtype, bias, gated, residual, config)
    y = torch._scaled_mm(q, w.data.t(), scale_a=scales, scale_b=w.scales.t(),
                         out_dtype=torch.bfloat16)[:m]
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    if gated:
        y = silu_and_mul(y)
    return y if residual is None else residual.add_(y)


def multiply(q: torch.Tensor, scales: torch.Tensor, m: int, w: Fp8Weight, dtype: torch.dtype,
             bias: torch.Tensor | None = None, gated: bool = False,
             residual: torch.Tensor | None = None,
             config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """_w8a8 on x's codes q [>= m, K] e4m3 and row scales [>= m, 1] fp32 -> [m, N] in dtype
    (m <= SMALL_M); as w8a8_linear after quantizing (bias [N (2N)], residual [m, N]
    contiguous)."""
    k = q.shape[1]
    rows = w.shape[0]
    n = rows // 2 if gated else rows
    if not 0 < m <= min(SMALL_M, q.shape[0], scales.shape[0]) or q.dtype != FP8:
        raise ValueError(f"w8a8 multiply: {m} rows (at most {SMALL_M}) of codes {q.dtype} "
                         f"{tuple(q.shape)} and scales {tuple(scales.shape)}")
    if k != w.shape[1] or w.block is not None or (gated and rows % 2):
        raise ValueError(f"w8a8 multiply: weight {w.shape} with block {w.block} for {k} inputs "
                         "(per-channel scales only; gated: an even number of rows)")
    block_n, split, num_warps, num_stages = config or _config(m, n, k, gated)
    launch, split = grid(cdiv(n, block_n), 1, split)
    out = torch.empty(m, n, dtype=dtype, device=q.device)
    launch_pdl = pdl(q.device)
    _w8a8[launch](
        q, scales, w.data, w.scales, bias, residual, out, partials(split, m, rows, q.device),
        counters(q.device), m, n, k, GATED=gated, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, BLOCK_M=max(16, next_power_of_2(m)),
        BLOCK_N=block_n, SPLIT_K=split, EVEN_K=k % 128 == 0, DOT_F32=_INTERPRET,
        PDL=launch_pdl, num_warps=num_warps, num_stages=num_stages, launch_pdl=launch_pdl > 0)
    return out
