"""RMSNorm module; the math lives in ops."""

from __future__ import annotations

import torch
from torch import nn

from frugal import ops


class RMSNorm(nn.Module):
    """weight: [hidden]. forward(x) -> x normalized in fp32, scaled by weight, in x's dtype.
    Before a matmul it is fused into the matmul instead (Linear.forward(x, norm=...))."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)
