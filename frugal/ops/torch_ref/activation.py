"""SwiGLU activation on the fused gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] as (gate | up) -> silu(gate) * up, [num_tokens, inter]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
