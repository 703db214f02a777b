"""Rotary tables: inverse frequencies (with Llama 3.1, linear or YaRN scaling) -> a cos|sin
cache."""

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
    kind = _kind(scaling)
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
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
    raise ValueError(f"rope_scaling: type {kind!r} is not supported (linear, llama3, yarn)")


def _kind(scaling: dict[str, Any] | None) -> str | None:
    """rope_scaling's type (transformers 5 `rope_type`, older `type`)."""
    return scaling.get("rope_type", scaling.get("type")) if scaling else None


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """YaRN (as transformers computes it): interpolated low frequencies, extrapolated high
    ones, a linear ramp between the dims of beta_fast and beta_slow rotations."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return inv_freq / factor * (1 - extrapolated) + inv_freq * extrapolated


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN multiplies cos and sin by (1 for other scalings)."""
    if _kind(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return _mscale(factor, m) / _mscale(factor, m_all)
    return _mscale(factor)


def softmax_mscale(scaling: dict[str, Any] | None) -> float:
    """DeepSeek's factor on the attention softmax scale under YaRN: mscale(factor,
    mscale_all_dim)² (1 without)."""
    if _kind(scaling) != "yarn":
        return 1.0
    m_all = scaling.get("mscale_all_dim") or 0
    return _mscale(scaling["factor"], m_all) ** 2 if m_all else 1.0


class RotaryEmbedding(nn.Module):
    """cos_sin: [max_positions, head_dim] fp32 buffer, (cos | sin) of position * inv_freq."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        factor = attention_factor(scaling)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1) * factor,
                             persistent=False)
