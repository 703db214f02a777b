"""Triton kernels for NVIDIA GPUs, with the signatures of frugal.ops.torch_ref.

Matmuls of many tokens stay with cuBLAS (FP8 W8A8 weights on torch's FP8 matmul beyond 64
tokens); quantized weights take our W4A16 / W8A8 / W8A16 kernels up to 64 tokens, and the
kernels here also cover the decode GEMV with its neighbours fused, attention over the paged
cache, the KV store, the small ops between matmuls and the KV-cache integrity check.

Its device choices (see frugal.ops): decode steps may be captured in CUDA graphs (whether a
model's attention allows it is its attention backend's say: layers.attention), greedy sampling
on the GPU takes the Triton argmax (ops.triton.sampling), and `configure` sets the kernels'
launch mode for the weights loaded (ops.triton.launch).
"""

from frugal.ops.triton.attention import paged_attention
from frugal.ops.triton.dsa import index_topk, sparse_mla_attention
from frugal.ops.triton.elementwise import rms_norm, silu_and_mul
from frugal.ops.triton.integrity import check_kv_pages
from frugal.ops.triton.kv_store import rotary_store_kv
from frugal.ops.triton.latent_store import store_index_key, store_latent
from frugal.ops.triton.launch import set_default
from frugal.ops.triton.linear import linear, pack_weight
from frugal.ops.triton.mla_decode import mla_attention
from frugal.ops.triton.moe import fused_moe
from frugal.ops.triton.moe_int4_tiles import pack_experts
from frugal.ops.triton.moe_route import route_experts
from frugal.ops.triton.moe_route_normed import norm_route_experts
from frugal.ops.triton.pages import copy_pages
from frugal.ops.triton.rotary import apply_rotary, apply_rotary_pairs
from frugal.ops.triton.sampling import argmax

CUDA_GRAPHS = True


def configure(quantized_kinds: set[str]) -> None:
    """The launch mode for the loaded weights (one setting a process, see ops.triton.launch):
    quantized_kinds: the kinds of quantized weight loaded ({"fp8", "int4"} or a subset; empty:
    unquantized)."""
    set_default("wait" if quantized_kinds else "trigger")


__all__ = ["CUDA_GRAPHS", "apply_rotary", "apply_rotary_pairs", "argmax", "check_kv_pages",
           "configure", "copy_pages", "fused_moe", "index_topk", "linear", "mla_attention",
           "norm_route_experts", "pack_experts", "pack_weight", "paged_attention", "rms_norm",
           "rotary_store_kv", "route_experts", "silu_and_mul", "sparse_mla_attention",
           "store_index_key", "store_latent"]
