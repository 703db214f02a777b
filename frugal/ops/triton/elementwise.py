"""Row-wise and element-wise ops in Triton: RMSNorm and SiLU·mul, for batches too large for the
fused GEMV (ops.triton.linear). Same signatures as their frugal.ops.torch_ref twins."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from frugal.ops.triton.launch import enter, pdl
from frugal.ops.triton.sizes import cdiv, next_power_of_2


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, eps, x_row, N: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    enter(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    # arithmetic in fp32, rounded to the activation dtype where torch's eager ops round
    x = tl.load(x_ptr + row.to(tl.int64) * x_row + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = w * (xf * inv).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * N + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden]; weight: [hidden]. Normalized in fp32, returned contiguous in x's
    dtype. Rows of x may be strided (a split of wider rows, as MLA's latent is): read in place."""
    shape = x.shape
    n = shape[-1]
    rows = x.reshape(-1, n) if x.dim() != 2 else x
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    launch_pdl = pdl(x.device)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, eps, rows.stride(0), N=n,
                                       BLOCK=next_power_of_2(n), PDL=launch_pdl,
                                       launch_pdl=launch_pdl > 0)
    return out.reshape(shape)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(x_ptr + row * 2 * N + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * N + N + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * inter] as (gate | up) -> silu(gate) * up: [num_tokens, inter]."""
    x = x.contiguous()
    n = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    block = min(1024, next_power_of_2(n))
    _silu_mul_kernel[(x.numel() // x.shape[-1], cdiv(n, block))](x, out, N=n, BLOCK=block)
    return out
