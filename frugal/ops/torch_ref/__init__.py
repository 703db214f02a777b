"""Plain PyTorch ops: the CPU path and the reference every fast kernel is tested against."""

from frugal.ops.torch_ref.activation import silu_and_mul
from frugal.ops.torch_ref.attention import paged_attention, rotary_store_kv, store_kv, v_key_minor
from frugal.ops.torch_ref.integrity import check_kv_pages
from frugal.ops.torch_ref.linear import linear, pack_weight
from frugal.ops.torch_ref.moe import fused_moe, route_experts
from frugal.ops.torch_ref.norm import rms_norm
from frugal.ops.torch_ref.rotary import apply_rotary

__all__ = ["apply_rotary", "check_kv_pages", "fused_moe", "linear", "pack_weight",
           "paged_attention", "rms_norm", "rotary_store_kv", "route_experts", "silu_and_mul",
           "store_kv", "v_key_minor"]
