"""GPTQ (Frantar et al., 2022) for INT4 weights: quantize a matrix column by column, pushing each
column's rounding error onto the columns not yet quantized, weighted by the inverse Hessian of
the layer's inputs (H = Σ x xᵀ over calibration tokens), so the layer's output moves as little as
the 4-bit grid allows. Groups get their scale and zero when their first column comes up (from
the weights as updated so far); or, with act_order, columns go in order of decreasing H[j, j]
(the inputs with the most energy first, while the most columns remain to absorb their error)
and each group's scale and zero come from the original weights ("static groups", so a group
stays one contiguous run of inputs on disk).

Hessians come from the engine itself: forward pre-hooks on every layer matmul accumulate the
inputs the matmul sees (after a fused RMSNorm) while calibration text runs through.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from frugal.layers.linear import Linear
from frugal.ops.torch_ref.norm import rms_norm
from frugal.quant.int4 import Int4Weight, group_params, pack


@contextlib.contextmanager
def hessians(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """While open, every Linear under model.layers adds xᵀx of its inputs ([in, in], fp64 on
    the CPU) to the yielded dict under its module name; the count of rows is under name + '#'."""
    found: dict[str, torch.Tensor] = {}
    handles = []

    def hook(name: str):
        def pre(module: Linear, args: tuple, kwargs: dict) -> None:
            x = args[0]
            norm = kwargs.get("norm", args[1] if len(args) > 1 else None)
            if norm is not None:
                x = rms_norm(x, norm.weight, norm.eps)
            x = x.detach().to("cpu", torch.float64).reshape(-1, x.shape[-1])
            if name not in found:
                found[name] = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
                found[name + "#"] = torch.zeros((), dtype=torch.float64)
            found[name].addmm_(x.t(), x)
            found[name + "#"] += x.shape[0]
        return pre

    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.startswith("model.layers."):
            handles.append(module.register_forward_pre_hook(hook(name), with_kwargs=True))
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def gptq(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, symmetric: bool,
         damp: float = 0.01, block: int = 128, act_order: bool = False) -> Int4Weight:
    """weight [N, K] float, hessian [K, K] (xᵀx of the inputs; any positive scale) -> INT4 with
    integer zeros, as quant.int4.quantize_rtn but error-compensated. damp: fraction of the mean
    diagonal added to H for a stable Cholesky factorization."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"group_size: {k} inputs do not split into groups of {group_size}")
    w = weight.double().clone()
    h = hessian.double().clone()
    dead = torch.diag(h) == 0  # inputs that were always 0: their weights do not matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    scales = torch.zeros(n, k // group_size, dtype=torch.float64)
    zeros = torch.zeros_like(scales)
    order = torch.arange(k)
    if act_order:
        scales, zeros = group_params(w.view(n, -1, group_size), symmetric)
        order = torch.argsort(torch.diag(h), descending=True)
        w, h = w[:, order], h[order][:, order]
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = torch.zeros(n, k, dtype=torch.uint8)
    for start in range(0, k, block):
        stop = min(start + block, k)
        w_block = w[:, start:stop].clone()
        errors = torch.zeros_like(w_block)
        h_block = hinv[start:stop, start:stop]
        for j in range(stop - start):
            col = start + j
            g = int(order[col]) // group_size
            if not act_order and col % group_size == 0:
                ahead = torch.cat([w_block[:, j:], w[:, stop:]], dim=1)[:, :group_size]
                scales[:, g], zeros[:, g] = group_params(ahead, symmetric)
            q = torch.round(w_block[:, j] / scales[:, g] + zeros[:, g]).clamp(0, 15)
            codes[:, order[col]] = q.to(torch.uint8)
            error = (w_block[:, j] - (q - zeros[:, g]) * scales[:, g]) / h_block[j, j]
            w_block[:, j:] -= error[:, None] * h_block[j, j:][None, :]
            errors[:, j] = error
        w[:, stop:] -= errors @ hinv[start:stop, stop:]
    return Int4Weight(pack(codes), scales.float(), zeros=zeros.float())
