"""Rotary tables: inverse frequencies (with Llama 3.1 or linear scaling) -> a cos|sin cache."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] fp32, computed exactly as HF transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling: type {kind!r} is not supported (linear, llama3)")


class RotaryEmbedding(nn.Module):
    """cos_sin: [max_positions, head_dim] fp32 buffer, (cos | sin) of position * inv_freq."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1),
                             persistent=False)
