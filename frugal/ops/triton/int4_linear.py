"""W4A16 matmul: INT4 weights dequantized in registers, on tensor cores.

`repack` turns a quant.int4.Int4Weight (any source: compressed-tensors, GGUF, our RTN/GPTQ) into
the kernel's layout once, at load time (Int4Tiles):
  words:  [N, Kp / 8] int32. The inputs are cut into tiles of TILE_K = 128 (Kp: K rounded up,
          the padding's codes 0); inside a tile, nibble j of word w holds input j * 16 + w.
          Shifting a tile's words right by 4 j therefore yields inputs j*16 .. j*16 + 15 of every
          row, in order: slice j, one [BLOCK_N, 16] operand of a tensor-core dot, with no
          interleaving; a word is loaded once for its eight slices.
  scales, mins: [Kp / group, N] in the activations' dtype (group-major, so a block of outputs
          reads contiguous values): w = u · scale + min for code u in [0, 15] (a zero point z
          becomes min = -z · scale).
A code becomes a bf16 (fp16) operand with one bitwise op: the bits 0x4300 | u (0x6400 | u) are
the number 128 + u (1024 + u), exact; the 128 is taken back per group, along with the min, from
Σx over the group: Σ_k x_k w_k = scale · Σ x (128 + u) + (min - 128 · scale) · Σ x.
Products accumulate in fp32. fp32 activations (and the CPU interpreter) convert codes with an
ordinary cast and multiply in exact fp32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from frugal.ops.triton.launch import enter, pdl
from frugal.ops.triton.split_k import counters, finish, grid, partials, tile_range
from frugal.quant.int4 import Int4Weight

TILE_K = 128
_SLICE = TILE_K // 8  # inputs per slice, and words per tile row
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRET_JIT = tl.constexpr(_INTERPRET)
# code -> operand bits and the value they add, per activation dtype
_MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


@dataclass
class Int4Tiles:
    """An INT4 weight [N, K] in the kernel's layout (see the module docstring)."""

    words: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    in_features: int
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.words.shape[0], self.in_features


def repack(q: Int4Weight, dtype: torch.dtype) -> Int4Tiles:
    """q (on the GPU) in the kernel's layout, scales and mins in dtype (the activations')."""
    n, k = q.shape
    group = q.group_size
    if group < 16 or (TILE_K % group and group % TILE_K):
        raise ValueError(f"INT4 kernel: group size {group} must be 16, 32, 64 or a multiple of "
                         f"{TILE_K}")
    kp = triton.cdiv(k, TILE_K) * TILE_K
    codes = F.pad(q.codes(), (0, kp - k)).to(torch.int32).view(n, kp // TILE_K, 8, _SLICE)
    words = torch.zeros(n, kp // TILE_K, _SLICE, dtype=torch.int32, device=codes.device)
    for j in range(8):
        words |= codes[:, :, j] << (4 * j)  # (wraps into the sign bit at j = 7, as intended)
    mins = q.mins if q.mins is not None else -q.zeros * q.scales
    pad = (0, (kp - k) // group) if group <= TILE_K else (0, 0)
    return Int4Tiles(words.view(n, kp // 8),
                     F.pad(q.scales.float(), pad).t().contiguous().to(dtype),
                     F.pad(mins.float(), pad).t().contiguous().to(dtype), k, group)


@triton.jit
def _int4_kernel(x_ptr, w_ptr, s_ptr, m_ptr, b_ptr, r_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                 KP: tl.constexpr, GROUP: tl.constexpr, GATED: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, MAGIC: tl.constexpr,
                 OFFSET: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
                 PRECISION: tl.constexpr, PDL: tl.constexpr):
    """out[m, n] = epilogue(Σ_k x[m, k] · w[n, k]) for a [BLOCK_M, BLOCK_N] block of outputs
    over this program's share of the K tiles (SPLIT_K > 1: reduced in split_k.finish).
    GATED: w holds 2N rows (gate, then up); the output is silu(gate) · up."""
    enter(PDL)
    SLICE: tl.constexpr = 16
    GROUP_K: tl.constexpr = GROUP if GROUP < 128 else 128  # inputs per scale within a tile
    SLICES: tl.constexpr = GROUP_K // SLICE
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_s = tl.arange(0, SLICE)
    first, last = tile_range(KP // 128, SPLIT_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * (KP // 8) + offs_s[:, None]
    x_rows = x_ptr + offs_m[:, None] * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    width = 2 * N if GATED else N  # rows of the weight, scales and partial sums
    for t in tl.range(first, last):
        words = tl.load(w_ptrs + t * SLICE, mask=n_mask[None, :], other=0)
        if GATED:
            words_up = tl.load(w_ptrs + N * (KP // 8) + t * SLICE, mask=n_mask[None, :],
                               other=0)
        for g in tl.static_range(128 // GROUP_K):
            part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            part_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            x_sum = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # Σx of the group, in each column
            for i in tl.static_range(SLICES):
                j = g * SLICES + i
                offs_k = t * 128 + j * SLICE + offs_s
                if EVEN_K:
                    x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
                else:
                    x = tl.load(x_rows + offs_k[None, :],
                                mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
                if DOT_F32:
                    x = x.to(tl.float32)
                # on the tensor cores too: a row sum here would cross the warps
                x_sum = tl.dot(x, tl.full([SLICE, BLOCK_N], 1.0, x.dtype), x_sum,
                               input_precision=PRECISION)
                w = _operand(words, j, MAGIC, DOT_F32, x.dtype)
                part = tl.dot(x, w, part, input_precision=PRECISION)
                if GATED:
                    w_up = _operand(words_up, j, MAGIC, DOT_F32, x.dtype)
                    part_up = tl.dot(x, w_up, part_up, input_precision=PRECISION)
            row = (t * 128 + g * GROUP_K) // GROUP * width
            scale = tl.load(s_ptr + row + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            low = tl.load(m_ptr + row + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            acc += part * scale[None, :] + x_sum * (low - OFFSET * scale)[None, :]
            if GATED:
                scale = tl.load(s_ptr + row + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                low = tl.load(m_ptr + row + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                acc_up += (part_up * scale[None, :]
                           + x_sum * (low - OFFSET * scale)[None, :])
    finish(acc, acc_up, offs_m, offs_n, m_mask, n_mask, M, N, part_ptr, count_ptr, b_ptr, r_ptr,
           out_ptr, GATED, HAS_BIAS, HAS_RESIDUAL, SPLIT_K)


@triton.jit
def _int4_gemv_kernel(x_ptr, w_ptr, s_ptr, m_ptr, b_ptr, r_ptr, out_ptr, part_ptr, count_ptr, N, K,
                      KP: tl.constexpr, GROUP: tl.constexpr, GATED: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
                      SPLIT_K: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr):
    """One row of x (decode at batch 1) on the CUDA cores: out[n] = epilogue(Σ_k x[k] w[n, k])
    for BLOCK_N outputs over this program's share of the tiles (SPLIT_K > 1: reduced in
    split_k.finish). A code becomes a float with one integer op and one add (see _code: the
    bits 0x4B000000 | u are 2^23 + u), so a weight costs three instructions with its multiply;
    each group's scale and min are applied to its partial sums, Σ x · (u · scale + min)."""
    enter(PDL)
    SLICE: tl.constexpr = 16
    GROUP_K: tl.constexpr = GROUP if GROUP < 128 else 128
    SLICES: tl.constexpr = GROUP_K // SLICE
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_s = tl.arange(0, SLICE)
    first, last = tile_range(KP // 128, SPLIT_K)
    width = 2 * N if GATED else N
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * (KP // 8) + offs_s[None, :]
    acc = tl.zeros([BLOCK_N, SLICE], tl.float32)
    acc_up = tl.zeros([BLOCK_N, SLICE], tl.float32)
    for t in tl.range(first, last, loop_unroll_factor=UNROLL):
        words = tl.load(w_ptrs + t * SLICE, mask=n_mask[:, None], other=0)
        high = (words.to(tl.uint32, bitcast=True) >> 12).to(tl.int32, bitcast=True)
        if GATED:
            words_up = tl.load(w_ptrs + N * (KP // 8) + t * SLICE, mask=n_mask[:, None],
                               other=0)
            high_up = (words_up.to(tl.uint32, bitcast=True) >> 12).to(tl.int32, bitcast=True)
        for g in tl.static_range(128 // GROUP_K):
            part = tl.zeros([BLOCK_N, SLICE], tl.float32)
            part_up = tl.zeros([BLOCK_N, SLICE], tl.float32)
            x_sum = tl.zeros([SLICE], tl.float32)
            for i in tl.static_range(SLICES):
                j = g * SLICES + i
                offs_k = t * 128 + j * SLICE + offs_s
                x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
                x_sum += x
                x = x * _power(j)  # exact: a power of two
                part += _code(words, high, j) * x[None, :]
                if GATED:
                    part_up += _code(words_up, high_up, j) * x[None, :]
            row = (t * 128 + g * GROUP_K) // GROUP * width
            scale = tl.load(s_ptr + row + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            low = tl.load(m_ptr + row + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            acc += part * scale[:, None] + low[:, None] * x_sum[None, :]
            if GATED:
                scale = tl.load(s_ptr + row + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                low = tl.load(m_ptr + row + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                acc_up += part_up * scale[:, None] + low[:, None] * x_sum[None, :]
    one = tl.arange(0, 1)  # (the shared ending works on [rows, outputs] blocks: one row here)
    finish(tl.sum(acc, 1)[None, :], tl.sum(acc_up, 1)[None, :], one, offs_n, one < 1, n_mask, 1,
           N, part_ptr, count_ptr, b_ptr, r_ptr, out_ptr, GATED, HAS_BIAS, HAS_RESIDUAL, SPLIT_K)


@triton.jit
def _code(words, high, j: tl.constexpr):
    """Codes of slice j times 16^p as exact fp32 values [BLOCK_N, 16] (p: _power(j)). A nibble
    is masked where it sits inside the mantissa of 2^23 (bits 0..22: nibbles 0..4 of a word,
    and 5..7 of `high`, the word shifted right by 12), so no shift per code is needed."""
    if j < 5:
        bits = _mask_or(words, 0xF << (4 * j))
    else:
        bits = _mask_or(high, 0xF << (4 * (j - 3)))
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _mask_or(src, MASK: tl.constexpr):
    """(src & MASK) | 0x4B000000, as one instruction (ptxas does not fuse the two itself)."""
    if _INTERPRET_JIT:  # (the interpreter runs no inline assembly)
        return (src & MASK) | 0x4B000000
    mask = tl.full(src.shape, MASK, tl.int32)
    return tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, 0x4B000000, 0xEA;", "=r,r,r",
                                     [src, mask], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _power(j: tl.constexpr):
    """1 / 16^p for the codes of slice j as _code returns them."""
    if j < 5:
        return 1.0 / (1 << (4 * j))
    return 1.0 / (1 << (4 * (j - 3)))


@triton.jit
def _operand(words, j: tl.constexpr, MAGIC: tl.constexpr, DOT_F32: tl.constexpr, dtype):
    """Slice j of a tile's words as a dot operand [BLOCK_N, 16]: codes as they are (fp32), or
    the bits MAGIC | u, which read in dtype as OFFSET + u."""
    u = (words >> (4 * j)) & 0xF
    if DOT_F32:  # (if / else, not an early return: the compiler traces both otherwise)
        w = u.to(tl.float32)
    else:
        w = (u | MAGIC).to(tl.int16).to(dtype, bitcast=True)
    return w


def _config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, SPLIT_K, num_warps, num_stages) for x [m, k] and a weight of n rows:
    the best of `benchmarks/quant_linear.py --sweep` on the H200 (Llama-3.1-8B shapes)."""
    if m <= 32:
        return (16 if m <= 16 else 32), 64, 4, 4, 3
    return 64, 64, 4, 2, 3


def int4_linear(x: torch.Tensor, w: Int4Tiles, bias: torch.Tensor | None = None,
                gated: bool = False, residual: torch.Tensor | None = None,
                config: tuple[int, ...] | None = None) -> torch.Tensor:
    """x: [M, K] (bf16, fp16 or fp32); w: [N (2N if gated), K] -> [M, N] in x's dtype: x @ wᵀ
    (+ bias), silu(gate) · up if gated, + residual. As ops.linear without the norm."""
    x = x.contiguous()
    m, k = x.shape
    rows = w.words.shape[0]
    n = rows // 2 if gated else rows
    if k != w.in_features:
        raise ValueError(f"int4_linear: x has {k} inputs, the weight {w.in_features}")
    if m == 1 and (config is None or len(config) == 4):
        return _gemv(x, w, bias, gated, residual, config)
    block_m, block_n, split, num_warps, num_stages = config or _config(m, rows, k)
    launch, split = grid(triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    f32 = x.dtype == torch.float32 or _INTERPRET
    magic, offset = (0, 0.0) if f32 else _MAGIC[x.dtype]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    launch_pdl = pdl(x.device)
    _int4_kernel[launch](
        x, w.words, w.scales, w.mins, bias, residual, out, partials(split, m, rows, x.device),
        counters(x.device), m, n, k, KP=w.words.shape[1] * 8, GROUP=w.group, GATED=gated,
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, SPLIT_K=split, MAGIC=magic, OFFSET=offset, EVEN_K=k % TILE_K == 0,
        DOT_F32=f32, PRECISION="ieee" if f32 else "tf32", PDL=launch_pdl,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=launch_pdl > 0)
    return out


def _gemv_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, SPLIT_K, num_warps, UNROLL) of the one-row kernel: 256 rows a program (eight
    per thread, over which each loaded input is reused), the tiles split so that there are
    about two programs per SM."""
    block_n = 256 if n >= 2048 else 64
    tiles = triton.cdiv(k, TILE_K)
    split = max(1, min(tiles // 2, triton.cdiv(264, triton.cdiv(n, block_n))))
    return block_n, split, 4, 1


def _gemv(x: torch.Tensor, w: Int4Tiles, bias: torch.Tensor | None, gated: bool,
          residual: torch.Tensor | None, config: tuple[int, ...] | None) -> torch.Tensor:
    """int4_linear of one row (config: (BLOCK_N, SPLIT_K, num_warps, UNROLL))."""
    rows = w.words.shape[0]
    n = rows // 2 if gated else rows
    k = x.shape[1]
    block_n, split, num_warps, unroll = config or _gemv_config(rows, k)
    launch, split = grid(triton.cdiv(n, block_n), 1, split)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    launch_pdl = pdl(x.device)
    _int4_gemv_kernel[launch](
        x, w.words, w.scales, w.mins, bias, residual, out, partials(split, 1, rows, x.device),
        counters(x.device), n, k, KP=w.words.shape[1] * 8, GROUP=w.group, GATED=gated,
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, BLOCK_N=block_n,
        SPLIT_K=split, UNROLL=unroll, PDL=launch_pdl, num_warps=num_warps, num_stages=1,
        launch_pdl=launch_pdl > 0)
    return out


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, m_ptr, out_ptr, N, K, KP: tl.constexpr,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[n, k] = u · scale + min for one block of rows and one 128-input tile."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    t = tl.program_id(1)
    offs_s = tl.arange(0, 16)
    words = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * (KP // 8) + t * 16 + offs_s[None, :],
                    mask=n_mask[:, None], other=0)
    for j in tl.static_range(8):
        row = (t * 128 + j * 16) // GROUP * N
        scale = tl.load(s_ptr + row + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        low = tl.load(m_ptr + row + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        u = ((words >> (4 * j)) & 0xF).to(tl.float32)
        offs_k = t * 128 + j * 16 + offs_s
        tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :],
                 (u * scale[:, None] + low[:, None]).to(out_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & (offs_k < K)[None, :])


def dequantize(w: Int4Tiles, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in dtype (for matmuls of many rows, which cuBLAS then runs)."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=dtype, device=w.words.device)
    _dequantize_kernel[(triton.cdiv(n, 64), w.words.shape[1] // 16)](
        w.words, w.scales, w.mins, out, n, k, KP=w.words.shape[1] * 8, GROUP=w.group,
        BLOCK_N=64)
    return out
