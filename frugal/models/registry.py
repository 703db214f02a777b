"""Architecture name (config.json `architectures[0]`) -> model class, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

from frugal.config import ModelConfig

_LLAMA = ("frugal.models.llama", "LlamaForCausalLM")
ARCHITECTURES = {
    "LlamaForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    "Qwen3MoeForCausalLM": _LLAMA,
    "Glm4MoeForCausalLM": _LLAMA,
    "DeepseekV2ForCausalLM": _LLAMA,
    "DeepseekV3ForCausalLM": _LLAMA,
    "GlmMoeDsaForCausalLM": _LLAMA,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    if config.architecture not in ARCHITECTURES:
        raise ValueError(f"architecture: {config.architecture!r} is not supported "
                         f"({', '.join(ARCHITECTURES)})")
    module, name = ARCHITECTURES[config.architecture]
    return getattr(importlib.import_module(module), name)
