"""Plain PyTorch ops: the CPU path and the reference every fast kernel is tested against.

Its device choices (see frugal.ops): no CUDA graphs (paged_attention reads the batch layout on
the host with .tolist(), the MLA stores index with boolean masks: shapes from device values),
torch's argmax for sampling, and no launch settings.
"""

from frugal.ops.torch_ref.activation import silu_and_mul
from frugal.ops.torch_ref.attention import paged_attention, rotary_store_kv, store_kv, v_key_minor
from frugal.ops.torch_ref.dsa import index_topk, sparse_mla_attention, store_index_key
from frugal.ops.torch_ref.integrity import check_kv_pages
from frugal.ops.torch_ref.linear import linear, pack_weight
from frugal.ops.torch_ref.mla import mla_attention, store_latent
from frugal.ops.torch_ref.moe import fused_moe, norm_route_experts, pack_experts, route_experts
from frugal.ops.torch_ref.norm import rms_norm
from frugal.ops.torch_ref.pages import copy_pages
from frugal.ops.torch_ref.rotary import apply_rotary, apply_rotary_pairs

CUDA_GRAPHS = False
argmax = None


def configure(quantized_kinds: set[str]) -> None:
    """Nothing to set: PyTorch's ops launch as they are."""


__all__ = ["CUDA_GRAPHS", "apply_rotary", "apply_rotary_pairs", "argmax", "check_kv_pages",
           "configure", "copy_pages", "fused_moe", "index_topk", "linear", "mla_attention",
           "norm_route_experts", "pack_experts", "pack_weight", "paged_attention", "rms_norm",
           "rotary_store_kv", "route_experts", "silu_and_mul", "sparse_mla_attention",
           "store_index_key", "store_kv", "store_latent", "v_key_minor"]
