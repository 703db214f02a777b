"""The SiLU-gated MLP (Llama's, and the shared experts of MoE models)."""

from __future__ import annotations

import torch
from torch import nn

from frugal.layers.linear import Linear, MergedLinear
from frugal.layers.norm import RMSNorm
from frugal.parallel import SINGLE, Parallel


class GatedMLP(nn.Module):
    """down(silu(gate(x)) · up(x)); gate and up fused into gate_up_proj (checkpoint gate_proj and
    up_proj fill its two halves). With tensor parallelism each rank holds a share of the
    intermediate features; its down output is a partial sum, all-reduced here if reduce."""

    def __init__(self, hidden_size: int, intermediate_size: int, parallel: Parallel = SINGLE,
                 reduce: bool = True) -> None:
        super().__init__()
        share = parallel.part(intermediate_size) if parallel.size > 1 else None
        inter = share[1] if share else intermediate_size
        self.gate_up_proj = MergedLinear(hidden_size, [inter] * 2, [0, 1],
                                         shard_rows=[share] * 2 if share else None)
        self.down_proj = Linear(inter, hidden_size, cols=share,
                                reduce=parallel if reduce else None)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [num_tokens, hidden] -> residual + mlp(norm(x)) (norm and residual fused into the
        matmuls; each optional)."""
        return self.down_proj(self.gate_up_proj(x, norm=norm, gated=True), residual=residual)
