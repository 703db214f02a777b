"""The last step of a fused MoE layer: each token's top_k expert outputs (and the residual)
summed in fp32 and rounded once, in a fixed order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from frugal.ops.triton.sizes import cdiv, next_power_of_2


@triton.jit
def _combine(out_ptr, res_ptr, dst_ptr, H, TOP_K: tl.constexpr, RESIDUAL: tl.constexpr,
             BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # (a fixed order: results do not depend on scheduling)
        acc += tl.load(out_ptr + (t * TOP_K + j) * H + cols, mask=ok, other=0.0).to(tl.float32)
    if RESIDUAL:
        acc += tl.load(res_ptr + t * H + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(dst_ptr + t * H + cols, acc.to(dst_ptr.dtype.element_ty), mask=ok)


def combine(out: torch.Tensor, top_k: int, residual: torch.Tensor | None,
            dtype: torch.dtype) -> torch.Tensor:
    """Each token's top_k slot outputs (out [tokens · top_k, hidden], a token's slots
    together) summed in fp32, plus residual [tokens, hidden] if given, rounded once to dtype:
    one launch."""
    slots, hidden = out.shape
    dst = torch.empty(slots // top_k, hidden, dtype=dtype, device=out.device)
    if slots == 0:
        return dst
    if residual is not None:
        residual = residual.contiguous()
    block = min(1024, next_power_of_2(hidden))
    _combine[(slots // top_k, cdiv(hidden, block))](
        out, residual if residual is not None else out, dst, hidden, TOP_K=top_k,
        RESIDUAL=residual is not None, BLOCK=block, num_warps=4)
    return dst
