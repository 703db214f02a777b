"""Triton kernels for NVIDIA GPUs, with the signatures of frugal.ops.torch_ref.

Matmuls stay with cuBLAS (F.linear); the kernels here cover attention over the paged cache, the KV
store and the small fused ops between matmuls.
"""

import torch
import torch.nn.functional as F

from frugal.ops.triton.attention import paged_attention
from frugal.ops.triton.elementwise import add_rms_norm, rms_norm, silu_and_mul
from frugal.ops.triton.kv_store import rotary_store_kv, store_kv


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """cuBLAS. x: [num_tokens, in]; weight: [out, in] -> [num_tokens, out]."""
    return F.linear(x, weight, bias)


__all__ = ["add_rms_norm", "linear", "paged_attention", "rms_norm",
           "rotary_store_kv", "silu_and_mul", "store_kv"]
