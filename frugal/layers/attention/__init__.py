"""Attention over the paged KV cache: the step's batch layout (AttentionMetadata) and a registry
of attention backends (base.AttentionBackend), one module each, imported on first use.

  mha  multi-head / grouped-query attention (Llama, Qwen, GLM-4.5: layers.attention.mha)
  mla  multi-head latent attention (DeepSeek-V2/V3, Kimi K2: layers.attention.mla)
  dsa  DeepSeek Sparse Attention over MLA's cache (GLM-5, DeepSeek-V3.2: layers.attention.dsa)

A model config names its backend (backend_name); the model builds its attention layers through
it and the worker asks it what graph capture needs (graph_capture_blocker).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields

import torch

from frugal.layers.attention.base import AttentionBackend
from frugal.model_config import ModelConfig


@dataclass
class AttentionMetadata:
    """How a step's tokens map onto requests and pages (all on the model's device).

    slot_mapping: [num_tokens] int64, where each new token's K/V is written;
    page_table: [num_requests, max_pages] int32; cu_seqlens_q: [num_requests + 1] int32;
    seq_lens: [num_requests] int32, each request's context length after this step;
    max_query_len, max_seq_len: host-side bounds of the new tokens and of seq_lens;
    num_decodes: how many requests at the front of the batch have one new token each;
    host_seq_lens: seq_lens on the host, where the step was built there (None in a CUDA graph
    and in the memory profile): shapes that depend on them need no device sync.
    captured: a step with prompt tokens inside a CUDA graph (worker.prompt_graphs): no shape
    may depend on a device value, nor on host_seq_lens.
    fresh_kv: a request's several new tokens may attend to one another's keys and values as
    computed, in the activation dtype, rather than to their copies in the cache (multi-head
    attention over a quantized cache: ops.paged_attention's fresh); False where a step must
    see what decode steps see through the cache (SamplingParams.prompt_from_cache).

    An eager step's metadata is built for it and not written afterwards: a layer may derive
    values from it once a step and reuse them in the layers after (mla_prefill.context). Only
    CUDA graphs' metadata is written in place between replays, and those steps never derive.
    """

    slot_mapping: torch.Tensor
    page_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_decodes: int = 0
    host_seq_lens: tuple[int, ...] | None = None
    captured: bool = False
    fresh_kv: bool = True


# name -> the module defining BACKEND (an AttentionBackend), imported when first asked for
BACKENDS = {"mha": "frugal.layers.attention.mha", "mla": "frugal.layers.attention.mla",
            "dsa": "frugal.layers.attention.dsa"}
_loaded: dict[str, AttentionBackend] = {}


def get_backend(name: str) -> AttentionBackend:
    """The backend registered as `name` (its module imported on first use)."""
    backend = _loaded.get(name)
    if backend is not None:
        return backend
    if name not in BACKENDS:
        raise ValueError(f"attention backend: unknown {name!r} ({', '.join(BACKENDS)})")
    backend = importlib.import_module(BACKENDS[name]).BACKEND
    if backend.name != name:
        raise TypeError(f"attention backend {name!r}: its module's BACKEND is {backend.name!r}")
    unknown = set(backend.metadata_fields) - {f.name for f in fields(AttentionMetadata)}
    if unknown:
        raise TypeError(f"attention backend {name!r}: reads {sorted(unknown)}, which "
                        "AttentionMetadata lacks")
    _loaded[name] = backend
    return backend


def backend_name(c: ModelConfig) -> str:
    """The attention a model config asks for: MLA's (sparse with DSA) when it has a latent,
    else multi-head."""
    if c.mla is None:
        return "mha"
    return "dsa" if c.dsa is not None else "mla"


def backend_for(c: ModelConfig) -> AttentionBackend:
    return get_backend(backend_name(c))


def graph_capture_blocker(c: ModelConfig) -> str | None:
    """None when the model's attention lets decode steps be captured in CUDA graphs, else the
    reason it does not (the backend's own words)."""
    return backend_for(c).graph_capture(c)


def prompt_graph_blocker(c: ModelConfig) -> str | None:
    """Likewise for steps with prompt tokens (worker.prompt_graphs)."""
    return backend_for(c).prompt_graphs(c)
