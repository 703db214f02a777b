"""The only code that knows devices. Layers call `ops.<name>`; the model runner picks the backend.

Backends are modules with the same function names and signatures: `torch_ref` (plain PyTorch, the
CPU path and the test oracle for every fast kernel) and `triton` (NVIDIA GPUs). Besides the ops,
a backend module states its device choices, so the runner asks it instead of naming one:
  CUDA_GRAPHS: bool            whether its decode steps may be captured in CUDA graphs;
  argmax: fn | None            a greedy-sampling argmax for GPU logits (None: torch's);
  configure(quantized_kinds)   process-wide launch settings for the weights loaded.

Each `ops.<name>` looks up the backend of the current context (a ContextVar, torch_ref unless
inside `ops.use(backend)`) on every call: a model runner runs its steps inside `ops.use`, so
engines with different backends can run in one process, on threads of their own, without
touching each other's binding. The cost is one ContextVar.get a call (tens of ns; a decode step
makes a few hundred op calls, and CUDA graphs replay kernels without any of this Python).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from types import ModuleType

from frugal.ops import torch_ref

OPS = ("linear", "rms_norm", "silu_and_mul", "rotary_store_kv", "paged_attention",
       "check_kv_pages", "route_experts", "norm_route_experts", "fused_moe", "apply_rotary",
       "apply_rotary_pairs", "store_latent", "mla_attention", "store_index_key", "index_topk",
       "sparse_mla_attention", "copy_pages")
BACKENDS = {"torch_ref": "frugal.ops.torch_ref", "triton": "frugal.ops.triton"}

_backend: ContextVar[ModuleType] = ContextVar("frugal.ops.backend", default=torch_ref)


def load(name: str) -> ModuleType:
    """The backend module (imported on first use: triton only where it is wanted)."""
    if name not in BACKENDS:
        raise ValueError(f"ops backend: unknown {name!r} ({', '.join(BACKENDS)})")
    return importlib.import_module(BACKENDS[name])


def current() -> ModuleType:
    """The backend `ops.<name>` calls go to in this context."""
    return _backend.get()


@contextlib.contextmanager
def use(backend: ModuleType) -> Iterator[None]:
    """Send every `ops.<name>` call of this context (this thread, this task) to `backend` for
    the duration of the block; nested blocks restore the outer binding on exit."""
    token = _backend.set(backend)
    try:
        yield
    finally:
        _backend.reset(token)


def _dispatch(name: str) -> Callable:
    """`ops.<name>`: the current backend's function, with torch_ref's signature and docstring."""
    get = _backend.get

    def op(*args, **kwargs):
        return getattr(get(), name)(*args, **kwargs)

    functools.update_wrapper(op, getattr(torch_ref, name))
    op.__module__ = __name__
    return op


linear = _dispatch("linear")
rms_norm = _dispatch("rms_norm")
silu_and_mul = _dispatch("silu_and_mul")
rotary_store_kv = _dispatch("rotary_store_kv")
paged_attention = _dispatch("paged_attention")
check_kv_pages = _dispatch("check_kv_pages")
route_experts = _dispatch("route_experts")
norm_route_experts = _dispatch("norm_route_experts")
fused_moe = _dispatch("fused_moe")
apply_rotary = _dispatch("apply_rotary")
apply_rotary_pairs = _dispatch("apply_rotary_pairs")
store_latent = _dispatch("store_latent")
mla_attention = _dispatch("mla_attention")
store_index_key = _dispatch("store_index_key")
index_topk = _dispatch("index_topk")
sparse_mla_attention = _dispatch("sparse_mla_attention")
copy_pages = _dispatch("copy_pages")
