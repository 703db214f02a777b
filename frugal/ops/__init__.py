"""The only code that knows devices. Layers call `ops.<name>`; the backend is picked once.

Backends are modules with the same function names and signatures: `torch_ref` (plain PyTorch, the
CPU path and the test oracle for every fast kernel); GPU backends register here beside it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from frugal.ops import torch_ref

OPS = ("linear", "rms_norm", "add_rms_norm", "silu_and_mul", "apply_rotary", "store_kv",
       "paged_attention")
BACKENDS = {"torch_ref": "frugal.ops.torch_ref"}
backend: str = "torch_ref"


def select(name: str) -> ModuleType:
    """Bind every op in this namespace to backend `name` (called once by the model runner)."""
    global backend
    if name not in BACKENDS:
        raise ValueError(f"ops backend: unknown {name!r} ({', '.join(BACKENDS)})")
    module = importlib.import_module(BACKENDS[name])
    for op in OPS:
        globals()[op] = getattr(module, op)
    backend = name
    return module


linear = torch_ref.linear
rms_norm = torch_ref.rms_norm
add_rms_norm = torch_ref.add_rms_norm
silu_and_mul = torch_ref.silu_and_mul
apply_rotary = torch_ref.apply_rotary
store_kv = torch_ref.store_kv
paged_attention = torch_ref.paged_attention
