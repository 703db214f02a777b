"""W4A16 matmul: INT4 weights dequantized in registers, on tensor cores.

`repack` turns a quant.int4.Int4Weight (any source: compressed-tensors, GGUF, our RTN/GPTQ) into
the kernel's layout once, at load time (Int4Tiles):
  words:  [R / 64, Kp / 128, 64, 16] int32: row blocks (R: the rows rounded up to 64, the padding
          0), tiles of TILE_K = 128 inputs (Kp: K rounded up, the padding's codes 0), a block's
          64 rows, 16 words a row; each block's tile one contiguous 4 KB, so a block of
          outputs streams its inputs as one contiguous run. Word 4 t + q of a row's tile (t, q
          in 0..3) holds the codes of inputs 32 q + 16 a + 8 b + 2 t + c (a, b, c in 0..1) in
          nibble (2 a + b) + 4 c: the eight codes one tensor-core thread (lane % 4 = t) needs
          from the 32 inputs of block q, each pair (c = 0, 1) 16 bits apart, so
          `(word >> 4 p) & 0x000F000F` is a ready pair (int4_wgmma). A thread's four words of a
          tile are contiguous (one 16-byte load).
  params: [Kp / group, N, 2] in the activations' dtype, group-major (a block of outputs reads
          contiguous values): each group's (scale, min), a 16-bit pair one 4-byte copy;
          w = u · scale + min for code u in [0, 15] (a zero point z becomes min = -z · scale).
          Centered weights (symmetric codes: every min is -8 · scale; N a multiple of 32) keep
          the scales alone, [Kp / group, N]: w = (u - 8) · scale, a tenth fewer bytes at
          groups of 32.
Up to SMALL_M rows in bf16 or fp16 on a Hopper GPU run int4_wgmma's kernel; anything else (more
rows, fp32 activations, older GPUs, the CPU interpreter) multiplies the weight `dequantize`d by
this module's Triton kernel, whose twin is Int4Weight.dequantize.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from frugal.ops import torch_ref
from frugal.ops.triton.int4_wgmma import _int4_wgmma, row_offsets
from frugal.ops.triton.launch import pdl
from frugal.ops.triton.sizes import cdiv, next_power_of_2
from frugal.ops.triton.split_k import counters, grid, partials
from frugal.quant.int4 import Int4Weight

TILE_K = 128
SMALL_M = 64  # most rows the tensor-core kernel takes (one block of rows)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_OFFSET = {torch.bfloat16: 128.0, torch.float16: 1024.0}  # the value of the operand bits 0


@dataclass
class Int4Tiles:
    """An INT4 weight [N, K] in the kernel's layout (see the module docstring)."""

    words: torch.Tensor
    params: torch.Tensor  # [Kp / group, N, 2] (scale, min) pairs; centered: [Kp / group, N]
    in_features: int
    group: int
    centered: bool = False  # every min is -8 · scale (symmetric codes), N % 32 == 0: scales alone

    @property
    def shape(self) -> tuple[int, int]:
        return self.params.shape[1], self.in_features

    @property
    def padded_k(self) -> int:  # Kp
        return self.words.shape[1] * TILE_K


def repack(q: Int4Weight, dtype: torch.dtype) -> Int4Tiles:
    """q (on the GPU) in the kernel's layout, scales and mins in dtype (the activations'); the
    scales alone (centered) where every min is -8 · scale and the rows are a multiple of 32."""
    n, k = q.shape
    group = q.group_size
    if group < 32 or (TILE_K % group and group % TILE_K):
        raise ValueError(f"INT4 kernel: group size {group} must be 32, 64 or a multiple of "
                         f"{TILE_K}")
    kp = cdiv(k, TILE_K) * TILE_K
    codes = F.pad(q.codes(), (0, kp - k)).to(torch.int32)
    c = codes.view(n, kp // TILE_K, 4, 2, 2, 4, 2).permute(0, 1, 5, 2, 3, 4, 6)  # tile,t,q,a,b,c
    blocks = cdiv(n, 64)
    words = torch.zeros(blocks * 64, kp // TILE_K, 4, 4, dtype=torch.int32, device=codes.device)
    for a in range(2):
        for b in range(2):
            for half in range(2):  # (half 1 at a = b = 1 wraps into the sign bit, as intended)
                words[:n] |= c[..., a, b, half] << (4 * (2 * a + b + 4 * half))
    words = words.view(blocks, 64, kp // TILE_K, 16).transpose(1, 2).contiguous()
    mins = q.mins if q.mins is not None else -q.zeros * q.scales
    pad = (0, (kp - k) // group) if group <= TILE_K else (0, 0)
    params = torch.stack([F.pad(q.scales.float(), pad).t(), F.pad(mins.float(), pad).t()], -1)
    params = params.to(dtype).contiguous()
    # (the kernel copies two 16-bit scales at once: their offsets, multiples of the rows or of
    # half the rows (gated), must be even where Triton can tell: multiples of 16)
    centered = n % 32 == 0 and bool(torch.equal(params[..., 1], -8 * params[..., 0]))
    if centered:
        params = params[..., 0].contiguous()
    return Int4Tiles(words, params, k, group, centered)


def uncentered(w):
    """w (Int4Tiles, moe_int4_tiles.Int4ExpertTiles) with (scale, min) pairs: a centered
    weight's mins written out (-8 · scale, exact)."""
    if not w.centered:
        return w
    return dataclasses.replace(w, params=torch.stack([w.params, -8 * w.params], -1),
                               centered=False)


def kernel_params(w) -> torch.Tensor:
    """w.params (Int4Tiles, moe_int4_tiles.Int4ExpertTiles) as int4_wgmma's kernels read
    them: a (scale, min) pair one int32, a centered weight's scale one int16."""
    return w.params.view(torch.int16 if w.centered else torch.int32)


def _config(m: int, n: int, k: int, gated: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, SPLIT_K, num_warps, STAGES) for x [m, k] and n outputs (2n rows if gated),
    near the best of `benchmarks/quant_linear.py --sweep` on the H200 (Llama-3.1-8B shapes):
    blocks of 64 outputs (one warpgroup), the inputs split until there are about 512 programs
    up to 8 rows, 384 up to 32 and 256 beyond (a gated block counting twice: it streams twice
    the rows), 8 tiles a part at least (4 at 17-32 rows, 16 beyond); a ring of 4 tiles (3
    beyond 16 rows). Blocks of 128 on two warpgroups (a ring of 4, about 160 programs) for
    gated matrices at 17-32 rows and for wide ones (8192 outputs or more) beyond 16."""
    if m > 16 and ((gated and m <= 32) or (not gated and n >= 8192)):
        block_n, warps, target = 128, 8, 160
    else:
        block_n, warps, target = 64, 4, 512 if m <= 8 else 384 if m <= 32 else 256
    blocks, tiles = cdiv(n, block_n) * (2 if gated else 1), cdiv(k, TILE_K)
    least = 8 if m <= 16 else 4 if m <= 32 else 16  # tiles a part streams at least
    split = 1
    while blocks * split * 2 <= target and tiles >= 2 * least * split:
        split *= 2
    return block_n, split, warps, 4 if m <= 16 or block_n == 128 else 3


def _unroll(stages: int, block_m: int, gated: bool) -> int:
    """Tiles a step of the kernel's loop takes: all the ring's (its stages constants: 7-22 %
    fewer instructions a tile) for gated matrices up to 16 rows (gate_up 5-9 % faster on the
    H200) and others at 9-32 rows (-1 to +8 %, +3 % on average); else one (at 1-8 and 64 rows
    it gained nothing; gated at 17-32 rows it would spill registers)."""
    return stages if (block_m <= 16 if gated else 16 <= block_m <= 32) else 1


@functools.cache
def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def int4_linear(x: torch.Tensor, w: Int4Tiles, bias: torch.Tensor | None = None,
                gated: bool = False, residual: torch.Tensor | None = None,
                config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x: [M, K] (bf16, fp16 or fp32); w: [N (2N if gated), K] -> [M, N] in x's dtype: x @ wᵀ
    (+ bias), silu(gate) · up if gated, + residual. As ops.linear without the norm."""
    x = x.contiguous()
    m, k = x.shape
    rows = w.shape[0]
    n = rows // 2 if gated else rows
    if k != w.in_features:
        raise ValueError(f"int4_linear: x has {k} inputs, the weight {w.in_features}")
    fast = (not _INTERPRET and x.device.type == "cuda" and x.dtype in _OFFSET
            and x.dtype == w.params.dtype and 0 < m <= SMALL_M and k % 2 == 0
            and _hopper(x.device))
    if not fast:  # (the kernel copies x's rows 4 bytes at least: K even; wgmma is sm_90's)
        return torch_ref.linear(x, dequantize(w, x.dtype), bias, gated=gated, residual=residual)
    block_n, split, num_warps, stages = config or _config(m, n, k, gated)
    if num_warps % 4 or block_n % (16 * num_warps):
        raise ValueError(f"int4_linear: {num_warps} warps (whole warpgroups) cannot share "
                         f"{block_n} outputs in 16-row slabs")
    align = 8 if k % 8 == 0 else 2  # (x's rows are copied 16 or 4 bytes at a time)
    block_m = max(8, next_power_of_2(m))
    launch, split = grid(cdiv(n, block_n), 1, split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    launch_pdl = pdl(x.device)
    _int4_wgmma[launch](
        x, w.words, kernel_params(w), bias, residual, out,
        partials(split, m, rows, x.device), counters(x.device), m, n, k // align,
        KP=w.padded_k, GROUP=w.group, GATED=gated, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, BLOCK_N=block_n,
        SPLIT_K=split, OFFSET=_OFFSET[x.dtype], EVEN_K=k % TILE_K == 0, K_ALIGN=align,
        BLOCK_M=block_m, WARPS=num_warps, STAGES=stages, UNROLL=_unroll(stages, block_m, gated),
        CENTERED=w.centered, PDL=launch_pdl,
        num_warps=num_warps, launch_pdl=launch_pdl > 0)
    return out


@triton.jit(do_not_specialize=["first"])
def _dequantize_kernel(w_ptr, p_ptr, out_ptr, N, K, first, swe, spe, soe, KP: tl.constexpr,
                       GROUP: tl.constexpr, CENTERED: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[n, k] = u · scale + min (CENTERED: the scales alone, min = -8 · scale) for one
    block of rows and one 128-input tile, stored as whole
    rows: the eight nibbles of the tile's words [BN, 4 (t), 4 (q)] are joined into
    [BN, t, q, b, a, c] (nibble 2 a + b + 4 c) and permuted to input order (q, a, b, t, c).
    Grid axis 2: stacked weights (experts first.., their words, params and outputs swe, spe and
    soe elements apart; one weight: 0)."""
    GK: tl.constexpr = GROUP if GROUP < 128 else 128
    e = tl.program_id(2).to(tl.int64)
    w_ptr += (first + e) * swe
    p_ptr += (first + e) * spe
    out_ptr += e * soe
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    tile = tl.program_id(1)
    offs_w = tl.arange(0, 16)
    block = row_offsets(offs_n, KP) + tile * 1024
    words = tl.load(w_ptr + block[:, None] + offs_w[None, :]).reshape(BLOCK_N, 4, 4)
    low_c = tl.join(tl.join(words & 0xF, (words >> 4) & 0xF),
                    tl.join((words >> 8) & 0xF, (words >> 12) & 0xF))  # [BN, t, q, b, a]
    high = words >> 16
    high_c = tl.join(tl.join(high & 0xF, (high >> 4) & 0xF),
                     tl.join((high >> 8) & 0xF, (high >> 12) & 0xF))
    codes = tl.join(low_c, high_c).permute(0, 2, 4, 3, 1, 5).reshape(BLOCK_N, 128 // GK, GK)
    offs_g = (tile * 128 + tl.arange(0, 128 // GK) * GK) // GROUP
    if CENTERED:
        scale = tl.load(p_ptr + offs_g[None, :] * N + offs_n[:, None], mask=n_mask[:, None],
                        other=0.0).to(tl.float32)
        low = -8.0 * scale
    else:
        pair = p_ptr + 2 * (offs_g[None, :] * N + offs_n[:, None])
        scale = tl.load(pair, mask=n_mask[:, None], other=0.0).to(tl.float32)
        low = tl.load(pair + 1, mask=n_mask[:, None], other=0.0).to(tl.float32)
    w = (codes.to(tl.float32) * scale[:, :, None] + low[:, :, None]).reshape(BLOCK_N, 128)
    offs_k = tile * 128 + tl.arange(0, 128)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :],
             w.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (offs_k < K)[None, :])


def dequantize(w: Int4Tiles, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in dtype (for matmuls of many rows, which cuBLAS then runs)."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=dtype, device=w.words.device)
    _dequantize_kernel[(cdiv(n, 64), w.words.shape[1], 1)](
        w.words, w.params, out, n, k, 0, 0, 0, 0, KP=w.padded_k, GROUP=w.group,
        CENTERED=w.centered, BLOCK_N=64)
    return out
