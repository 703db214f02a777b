"""RMSNorm module; the math lives in ops."""

from __future__ import annotations

import torch
from torch import nn

from frugal import ops


class RMSNorm(nn.Module):
    """weight: [hidden]. forward(x) or forward(x, residual) -> (normed, residual + x)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)
