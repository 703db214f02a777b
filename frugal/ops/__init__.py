"""The only code that knows devices. Layers call `ops.<name>`; the model runner picks the backend.

Backends are modules with the same function names and signatures: `torch_ref` (plain PyTorch, the
CPU path and the test oracle for every fast kernel) and `triton` (NVIDIA GPUs). A model runner
runs its steps inside `ops.use(backend)`, so engines with different backends can share a process.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from types import ModuleType

from frugal.ops import torch_ref

OPS = ("linear", "rms_norm", "silu_and_mul", "rotary_store_kv", "paged_attention",
       "check_kv_pages", "route_experts", "fused_moe", "apply_rotary", "apply_rotary_pairs",
       "store_latent", "mla_attention", "store_index_key", "index_topk", "sparse_mla_attention")
BACKENDS = {"torch_ref": "frugal.ops.torch_ref", "triton": "frugal.ops.triton"}


def load(name: str) -> ModuleType:
    """The backend module (imported on first use: triton only where it is wanted)."""
    if name not in BACKENDS:
        raise ValueError(f"ops backend: unknown {name!r} ({', '.join(BACKENDS)})")
    return importlib.import_module(BACKENDS[name])


@contextlib.contextmanager
def use(backend: ModuleType) -> Iterator[None]:
    """Bind every op in this namespace to `backend` for the duration of the block."""
    namespace = globals()
    saved = {op: namespace[op] for op in OPS}
    namespace.update({op: getattr(backend, op) for op in OPS})
    try:
        yield
    finally:
        namespace.update(saved)


linear = torch_ref.linear
rms_norm = torch_ref.rms_norm
silu_and_mul = torch_ref.silu_and_mul
rotary_store_kv = torch_ref.rotary_store_kv
paged_attention = torch_ref.paged_attention
check_kv_pages = torch_ref.check_kv_pages
route_experts = torch_ref.route_experts
fused_moe = torch_ref.fused_moe
apply_rotary = torch_ref.apply_rotary
apply_rotary_pairs = torch_ref.apply_rotary_pairs
store_latent = torch_ref.store_latent
mla_attention = torch_ref.mla_attention
store_index_key = torch_ref.store_index_key
index_topk = torch_ref.index_topk
sparse_mla_attention = torch_ref.sparse_mla_attention
