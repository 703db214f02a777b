"""Linear layers whose parameters know how to load themselves from HF-named checkpoint tensors."""

from __future__ import annotations

import torch
from torch import nn

from frugal import ops
from frugal.layers.norm import RMSNorm


def load_whole(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """Default loader: the checkpoint tensor is the whole parameter."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape {tuple(loaded.shape)} in checkpoint, model expects "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x @ weight.T (+ bias). weight: [out_features, in_features]; x: [num_tokens, in]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.load_shard
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.load_shard

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard_id: object = None) -> None:
        load_whole(param, loaded)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, gated: bool = False,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """Optionally fused around the matmul (see ops.linear): norm before, silu(gate)·up of
        the output halves and the residual add after."""
        if norm is None:
            return ops.linear(x, self.weight, self.bias, gated=gated, residual=residual)
        return ops.linear(x, self.weight, self.bias, norm.weight, norm.eps, gated, residual)


class MergedLinear(Linear):
    """Several projections of the same input in one matmul (q|k|v, gate|up).

    shard_ids name the parts in output order; the checkpoint's separate tensors fill their rows.
    """

    def __init__(self, in_features: int, output_sizes: list[int], shard_ids: list[object],
                 bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = output_sizes
        offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self.shards = {s: (o, n) for s, o, n in zip(shard_ids, offsets, output_sizes)}

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard_id: object = None) -> None:
        if shard_id not in self.shards:
            raise ValueError(f"unknown shard {shard_id!r} (expected one of {list(self.shards)})")
        offset, size = self.shards[shard_id]
        load_whole(nn.Parameter(param.data.narrow(0, offset, size), requires_grad=False), loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.output_sizes, dim=-1)
