"""Rotary position embedding, GPT-NeoX layout (each head's dims split into two rotating halves)."""

from __future__ import annotations

import torch


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim];
    positions: [num_tokens] int64; cos_sin: [max_positions, rotary_dim] fp32 as (cos | sin)
    halves. The first rotary_dim dims of each head rotate (rotary_dim < head_dim: partial
    rotary, as GLM does), the rest pass through.

    Returns rotated (q, k) in their input dtype; the rotation itself is computed in fp32.
    """
    cos, sin = cos_sin.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def apply_rotary_pairs(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                       cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary with the dims rotating in adjacent pairs (2i, 2i + 1) by frequency i
    (DeepSeek's interleaved layout), every dim rotary; the layout is kept."""
    cos, sin = cos_sin.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2).to(
            x.dtype)

    return rotate(q), rotate(k)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = 2 * cos.shape[-1]
    x1, x2 = x[..., :rot].float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return rotated if rot == x.shape[-1] else torch.cat([rotated, x[..., rot:]], dim=-1)
