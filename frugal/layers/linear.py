"""Linear layers whose parameters know how to load themselves from HF-named checkpoint tensors."""

from __future__ import annotations

import logging

import torch
from torch import nn

from frugal import ops
from frugal.layers.norm import RMSNorm
from frugal.parallel import Parallel
from frugal.quant.fp8 import Fp8Weight, quantize_fp8
from frugal.quant.int4 import Int4Weight, quantize_rtn

logger = logging.getLogger("frugal")


def load_whole(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """Default loader: the checkpoint tensor is the whole parameter."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape {tuple(loaded.shape)} in checkpoint, model expects "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded)


def narrow(loaded: torch.Tensor, dim: int, share: tuple[int, int] | None) -> torch.Tensor:
    """A checkpoint tensor's slice (start, length) along dim, or all of it for share None."""
    if share is None or loaded.dim() <= dim:
        return loaded
    start, length = share
    if start + length > loaded.shape[dim]:
        raise ValueError(f"shape {tuple(loaded.shape)} in checkpoint, model expects at least "
                         f"{start + length} along dim {dim}")
    return loaded.narrow(dim, start, length)


class Linear(nn.Module):
    """y = x @ weight.T (+ bias). weight: [out_features, in_features]; x: [num_tokens, in].

    A quantized layer keeps its weight as qweight (quant.int4.Int4Weight or quant.fp8.Fp8Weight,
    all shards concatenated; the ops backend may repack it for its kernel, see
    engine.model_runner) and an empty float weight.

    Tensor parallelism (frugal.parallel): rows (start, length) names the checkpoint rows a
    column-parallel layer holds (out_features = length), cols the inputs a row-parallel one
    holds; reduce: the ranks whose partial outputs are summed (row-parallel) before the bias
    (added once) and the residual."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
                 reduce: Parallel | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.rows, self.cols = rows, cols
        self.reduce = reduce if reduce is not None and reduce.size > 1 else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.load_shard
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.load_shard
        self.qweight: Int4Weight | Fp8Weight | object | None = None
        self._shards: dict[object, Int4Weight | Fp8Weight] = {}

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard_id: object = None) -> None:
        load_whole(param, narrow(narrow(loaded, 0, self.rows), 1, self.cols))

    def load_quantized(self, loaded: Int4Weight | Fp8Weight, shard_id: object = None) -> None:
        """Take a quantized weight (or one shard of it); once all shards are in, the float
        weight is dropped."""
        if self.rows is not None or self.cols is not None or getattr(self, "shard_rows", None):
            raise ValueError("tensor_parallel_size: quantized checkpoint weights are not split "
                             "across ranks yet")
        order = list(getattr(self, "shards", [None]))
        if shard_id not in order:
            raise ValueError(f"unknown shard {shard_id!r} (expected one of {order})")
        rows = self.shards[shard_id][1] if shard_id is not None else self.out_features
        if tuple(loaded.shape) != (rows, self.in_features):
            raise ValueError(f"shape {tuple(loaded.shape)} in checkpoint, model expects "
                             f"{(rows, self.in_features)}")
        self._shards[shard_id] = loaded
        if len(self._shards) == len(order):
            parts = [self._shards.pop(s) for s in order]
            if len({type(p) for p in parts}) != 1:
                raise ValueError("shards quantized in different formats")
            self._use_quantized(type(parts[0]).cat(parts) if len(parts) > 1 else parts[0])

    def quantize(self, scheme: str, group_size: int = 128) -> None:
        """Round the float weight in place: scheme int4 (symmetric, groups of group_size) or
        fp8 (per output channel, activations per token: W8A8)."""
        w = self.weight.data
        self._use_quantized(quantize_rtn(w, group_size, symmetric=True) if scheme == "int4"
                            else quantize_fp8(w, w8a8=True))

    def _use_quantized(self, q: Int4Weight | Fp8Weight) -> None:
        """From now on multiply with q (moved to the layer's device); drop the float weight."""
        device = self.weight.device
        self.qweight = q.to(device)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=device)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, gated: bool = False,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """Optionally fused around the matmul (see ops.linear): norm before, silu(gate)·up of
        the output halves and the residual add after."""
        weight = self.weight if self.qweight is None else self.qweight
        if self.reduce is not None:  # (partial sums: the bias and residual once, after)
            y = self.reduce.all_reduce(self._matmul(x, weight, None, norm, gated, None))
            y = y if self.bias is None else y + self.bias
            return y if residual is None else y + residual
        return self._matmul(x, weight, self.bias, norm, gated, residual)

    @staticmethod
    def _matmul(x, weight, bias, norm, gated, residual) -> torch.Tensor:
        if norm is None:
            return ops.linear(x, weight, bias, gated=gated, residual=residual)
        return ops.linear(x, weight, bias, norm.weight, norm.eps, gated, residual)


class MergedLinear(Linear):
    """Several projections of the same input in one matmul (q|k|v, gate|up).

    shard_ids name the parts in output order; the checkpoint's separate tensors fill their rows.
    shard_rows: with tensor parallelism, the (start, length) of each checkpoint tensor's rows
    this rank holds (output_sizes are then the lengths).
    """

    def __init__(self, in_features: int, output_sizes: list[int], shard_ids: list[object],
                 bias: bool = False, shard_rows: list[tuple[int, int]] | None = None) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = output_sizes
        offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self.shards = {s: (o, n) for s, o, n in zip(shard_ids, offsets, output_sizes)}
        self.shard_rows = dict(zip(shard_ids, shard_rows)) if shard_rows else {}

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard_id: object = None) -> None:
        if shard_id not in self.shards:
            raise ValueError(f"unknown shard {shard_id!r} (expected one of {list(self.shards)})")
        offset, size = self.shards[shard_id]
        load_whole(nn.Parameter(param.data.narrow(0, offset, size), requires_grad=False),
                   narrow(loaded, 0, self.shard_rows.get(shard_id)))

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.output_sizes, dim=-1)


def quantize_layers(model: nn.Module, scheme: str) -> None:
    """Quantize every layer matmul the checkpoint did not bring quantized, rounding to nearest:
    int4 in the largest group of 128, 64, 32 that divides its inputs, or fp8 per output
    channel; embeddings and the LM head stay. A matrix the checkpoint brought in the other
    format is an error (one scheme per model)."""
    kept = rounded = 0
    want = Int4Weight if scheme == "int4" else Fp8Weight
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or not name.startswith("model.layers."):
            continue
        if module.qweight is not None:
            if not isinstance(module.qweight, want):
                raise ValueError(f"quantization {scheme}: {name} is stored as "
                                 f"{type(module.qweight).__name__} in the checkpoint")
            kept += 1
            continue
        group = next((g for g in (128, 64, 32) if module.in_features % g == 0), None)
        if scheme == "int4" and group is None:
            raise ValueError(f"quantization: {name} has {module.in_features} inputs, not a "
                             "multiple of 32")
        module.quantize(scheme, group or 128)
        rounded += 1
    logger.info("%s weights: %d matrices as the checkpoint stores them, %d rounded to nearest",
                scheme.upper(), kept, rounded)
