"""Dense linear layer on plain PyTorch, with the ops around a matmul that fast paths fuse."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from frugal.ops.torch_ref.activation import silu_and_mul
from frugal.ops.torch_ref.norm import rms_norm
from frugal.quant.fp8 import Fp8Weight, round_rows
from frugal.quant.int4 import Int4Weight

# Up to this many tokens, weight @ x.T runs 1.3-3x faster than x @ weight.T through MKL's sgemm on
# the 2-core AVX2 machines we test on (measured for decode batches); beyond it, F.linear wins.
_SMALL_M = 128


def linear(x: torch.Tensor, weight: torch.Tensor | Int4Weight | Fp8Weight,
           bias: torch.Tensor | None = None, norm: torch.Tensor | None = None, eps: float = 0.0,
           gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_tokens, in]; weight: [out, in] (INT4 or FP8: its dequantization in x's dtype,
    and with a w8a8 FP8 weight x rounded per token to FP8 too);
    bias: [out] or None -> [num_tokens, out].

    Fusable neighbours, applied in this order: norm ([in]): x is RMS-normalized (eps) and scaled
    by norm first; gated: the output's two halves (gate | up) become silu(gate) · up, [n, out/2];
    residual ([num_tokens, out']): added last. The caller hands the residual over: fast
    backends may write the sum into its storage.
    """
    w8a8 = isinstance(weight, Fp8Weight) and weight.w8a8
    if isinstance(weight, (Int4Weight, Fp8Weight)):
        weight = weight.dense(x.dtype)
    if norm is not None:
        x = rms_norm(x, norm, eps)
    if w8a8:  # activations rounded to FP8 per token, as the FP8 matmul sees them
        x = round_rows(x)
    y = _matmul(x, weight, bias)
    if gated:
        y = silu_and_mul(y)
    return y if residual is None else residual + y


def pack_weight(weight: Int4Weight | Fp8Weight, dtype: torch.dtype) -> Int4Weight | Fp8Weight:
    """A quantized weight in the layout this backend's linear reads: as it is (linear
    dequantizes it on first use)."""
    return weight


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.shape[0] > _SMALL_M or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(weight, x.t()).t().contiguous()
    return torch.addmm(bias[:, None], weight, x.t()).t().contiguous()
