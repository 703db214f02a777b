"""Mixture of experts in plain PyTorch: routing (softmax top-k; grouped sigmoid top-k with a
correction bias) and the experts' gated MLPs, one expert at a time over the tokens routed to it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from frugal.ops.torch_ref.norm import rms_norm
from frugal.quant.experts import Experts, Fp8Experts, dequantize
from frugal.quant.fp8 import round_groups


def pack_experts(w: torch.Tensor | Experts, dtype: torch.dtype) -> torch.Tensor | Experts:
    """Routed experts as this backend's ops read them: as they are."""
    return w


def route_experts(x: torch.Tensor, router: torch.Tensor, correction_bias: torch.Tensor | None,
                  top_k: int, scoring: str, renormalize: bool, n_group: int, topk_group: int,
                  scaling: float, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights, from fp32 router logits x @ routerᵀ.

    x: [num_tokens, hidden]; router: [num_experts, hidden]; correction_bias: [num_experts] fp32
    or None. scoring softmax: the top_k probabilities (renormalized: divided by their sum).
    scoring sigmoid: experts chosen by sigmoid + correction_bias, among the topk_group best of
    n_group groups (a group scores the sum of its two best), weighted by their sigmoid
    (renormalized: divided by their sum + 1e-20). Weights are multiplied by scaling.
    shared: shared experts stacked after the router's num_experts (layers.moe fuses them):
    every token also takes experts num_experts .. num_experts + shared - 1, weight 1.0.
    Returns (weights [num_tokens, top_k + shared] fp32, expert ids [num_tokens, top_k + shared]
    int64).
    """
    weights, ids = _route(x, router, correction_bias, top_k, scoring, renormalize, n_group,
                          topk_group)
    weights = weights * scaling
    if shared:
        num_tokens, num_experts = x.shape[0], router.shape[0]
        extra = torch.arange(num_experts, num_experts + shared, device=x.device)
        ids = torch.cat([ids, extra.expand(num_tokens, shared)], dim=1)
        weights = torch.cat([weights, weights.new_ones(num_tokens, shared)], dim=1)
    return weights, ids


def _route(x: torch.Tensor, router: torch.Tensor, correction_bias: torch.Tensor | None,
           top_k: int, scoring: str, renormalize: bool, n_group: int, topk_group: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """route_experts' routed choice, unscaled."""
    logits = x.float() @ router.float().t()
    if scoring == "softmax":
        weights, ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    scores = logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1:
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(topk_group, dim=-1).indices
        keep = torch.zeros(num_tokens, n_group, dtype=torch.bool, device=x.device)
        keep.scatter_(1, best, True)
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(num_tokens, -1)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights, ids


def norm_route_experts(h: torch.Tensor, norm: torch.Tensor, eps: float, router: torch.Tensor,
                       correction_bias: torch.Tensor | None, top_k: int, scoring: str,
                       renormalize: bool, n_group: int, topk_group: int, scaling: float,
                       shared: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE layer's input and routing from the residual stream h [num_tokens, hidden]:
    (x = rms_norm(h, norm, eps), *route_experts(x, ...)) (norm: the RMSNorm's weight)."""
    x = rms_norm(h, norm, eps)
    return (x, *route_experts(x, router, correction_bias, top_k, scoring, renormalize, n_group,
                              topk_group, scaling, shared))


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor | Experts, down: torch.Tensor | Experts,
              weights: torch.Tensor, ids: torch.Tensor,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """Σ over each token's experts of weight · down(silu(gate) · up), in x's dtype; with
    residual ([num_tokens, hidden]) residual + Σ, added in fp32 before the one rounding.

    x: [num_tokens, hidden]; gate_up: [num_experts, 2 * inter, hidden] (gate rows, then up);
    down: [num_experts, hidden, inter], either float or quantized (quant.experts: dequantized
    one expert at a time); weights, ids: [num_tokens, top_k] (route_experts). Each expert's
    matmuls run in x's dtype, their inputs rounded to FP8 per row and 128 inputs first for
    W8A8 experts (Fp8Experts.w8a8); the weighted sum is accumulated in fp32.
    """
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for expert in ids.unique().tolist():
        token, slot = (ids == expert).nonzero(as_tuple=True)
        gate, up = F.linear(_rounded(x[token], gate_up),
                            dequantize(gate_up, expert, x.dtype)).chunk(2, dim=-1)
        y = F.linear(_rounded(F.silu(gate) * up, down), dequantize(down, expert, x.dtype))
        out.index_add_(0, token, y.float() * weights[token, slot, None])
    if residual is not None:
        out += residual.float()
    return out.to(x.dtype)


def _rounded(x: torch.Tensor, w: torch.Tensor | Experts) -> torch.Tensor:
    """x as w's matmul sees it: rounded to FP8 per row and 128 inputs for W8A8 experts."""
    return round_groups(x) if isinstance(w, Fp8Experts) and w.w8a8 else x
