"""The SiLU-gated MLP (Llama's, and the shared experts of MoE models)."""

from __future__ import annotations

import torch
from torch import nn

from frugal.layers.linear import Linear, MergedLinear
from frugal.layers.norm import RMSNorm


class GatedMLP(nn.Module):
    """down(silu(gate(x)) · up(x)); gate and up fused into gate_up_proj (checkpoint gate_proj and
    up_proj fill its two halves)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, [0, 1])
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [num_tokens, hidden] -> residual + mlp(norm(x)) (norm and residual fused into the
        matmuls; each optional)."""
        return self.down_proj(self.gate_up_proj(x, norm=norm, gated=True), residual=residual)
