"""Routing in one launch: a token's expert scores, their choice and their weights by one program.

torch_ref.route_experts spells routing as ~10 small ops (softmax or sigmoid, the group scores,
their top-k, a mask, the top-k, a gather, the renormalization, the scaling): at decode batch
sizes each costs a launch and more than its work. Here `_logits` computes the router logits
(x @ routerᵀ, read in their own dtype, fp32 products and sums: no fp32 copy of the router is
made) and `_route` takes one program a token over all its experts (up to BLOCK_E = the next
power of two):
  softmax: the top_k probabilities, renormalized to sum 1 if asked (Qwen3-MoE);
  sigmoid: experts chosen by sigmoid + correction bias, among the topk_group best of n_group
           groups (a group scores the sum of its two best), weighted by their sigmoid,
           renormalized by their sum + 1e-20 if asked (GLM-4.5, DeepSeek-V3, Kimi K2);
then times routed_scaling. The top k are found by k rounds of argmax (k ≤ 8 at real shapes;
ties go to the lower expert id), each one reduction (the best and its index together), by
one warp up to 256 experts: shuffles, no barriers (on four warps a token's 8 rounds over
Qwen3's 128 experts took 5 µs of an H200's decode step). Grouping needs the experts to fill
BLOCK_E exactly (a power of two: DeepSeek-V3's 256 in 8 groups); otherwise the torch ops
route (route_experts falls back).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from frugal.ops.torch_ref.moe import route_experts as route_experts_torch
from frugal.ops.triton.launch import enter, pdl
from frugal.ops.triton.sizes import cdiv, next_power_of_2

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DECODE_SPLITS = 8  # slices of the router's inputs at up to SPLIT_TOKENS tokens (router_logits)
SPLIT_TOKENS = 128


@triton.jit(do_not_specialize=["T"])  # (T, the step's tokens, changes from step to step)
def _logits(x_ptr, w_ptr, out_ptr, T, E, K, slice_k, sxt, swe, F32_DOT: tl.constexpr,
            BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
            PDL: tl.constexpr):
    """out[s, t, e] = Σ_k x[t, k] · w[e, k] in fp32 over the s-th slice_k inputs: BLOCK_T
    tokens × BLOCK_E experts × one slice a program."""
    enter(PDL)
    rows = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    split = tl.program_id(2)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k0 in range(split * slice_k, tl.minimum(K, (split + 1) * slice_k), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxt + ks[None, :],
                    mask=(rows[:, None] < T) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * swe + ks[None, :],
                    mask=(cols[:, None] < E) & (ks[None, :] < K), other=0.0)
        if F32_DOT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:  # (bf16 / fp16 products are exact in fp32; the sums are fp32)
            acc += tl.dot(x, tl.trans(w))
    out = out_ptr + split.to(tl.int64) * T * E
    tl.store(out + rows[:, None].to(tl.int64) * E + cols[None, :], acc,
             mask=(rows[:, None] < T) & (cols[None, :] < E))


def router_logits(x: torch.Tensor, router: torch.Tensor, splits: int = 1) -> torch.Tensor:
    """x [T, hidden] @ router [E, hidden]ᵀ in fp32, as [S, T, E] partial sums over S ≤ splits
    slices of hidden (their sum is torch_ref's x.float() @ router.float().t()), one launch.
    A program takes 16 tokens × 16 experts up to 16 tokens, 32 × 32 up to SPLIT_TOKENS, 64 × 64
    beyond; slices spread a decode step's router over the SMs (Qwen3's 128 experts and 8
    slices: 64 programs at one token, each reading 8 KiB of the router, not 8 reading 64 KiB;
    at 64 tokens 64 programs, not the 2 of 64 × 64 tiles unsliced, which took 14.6 µs of an
    H100's decode step a layer)."""
    t, k = x.shape
    e = router.shape[0]
    block_t, block_e, block_k = ((16, 16, 256) if t <= 16 else
                                 (32, 32, 64) if t <= SPLIT_TOKENS else (64, 64, 64))
    slice_k, splits = slices(k, splits, block_k)
    out = torch.empty(splits, t, e, dtype=torch.float32, device=x.device)
    f32 = _INTERPRET or x.dtype != router.dtype or x.dtype == torch.float32
    grid = (cdiv(e, block_e), cdiv(t, block_t), splits)
    launch_pdl = pdl(x.device)
    _logits[grid](x, router, out, t, e, k, slice_k, x.stride(0), router.stride(0), F32_DOT=f32,
                  BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, PDL=launch_pdl,
                  num_warps=4, launch_pdl=launch_pdl > 0)
    return out


@triton.jit(do_not_specialize=["T"])  # (T, the step's tokens, changes from step to step)
def _route(logits_ptr, bias_ptr, weights_ptr, ids_ptr, T, E, scaling, SPLITS: tl.constexpr,
           TOP_K: tl.constexpr, SHARED: tl.constexpr,
           TOP_PAD: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
           RENORMALIZE: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
           BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    x = tl.load(logits_ptr + row * E + offs, mask=ok, other=float("-inf"))
    for s in tl.static_range(1, SPLITS):  # (the router logits' partial sums, in order)
        x += tl.load(logits_ptr + (s * T + row) * E + offs, mask=ok, other=0.0)
    width = TOP_K + SHARED
    choose(x, offs, ok, E, bias_ptr, weights_ptr + row * width, ids_ptr + row * width, scaling,
           TOP_K, SHARED, TOP_PAD, SIGMOID, HAS_BIAS, RENORMALIZE, N_GROUP, TOPK_GROUP, BLOCK_E)


@triton.jit
def choose(x, offs, ok, E, bias_ptr, weights_ptr, ids_ptr, scaling, TOP_K: tl.constexpr,
           SHARED: tl.constexpr, TOP_PAD: tl.constexpr, SIGMOID: tl.constexpr,
           HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, N_GROUP: tl.constexpr,
           TOPK_GROUP: tl.constexpr, BLOCK_E: tl.constexpr):
    """One token's experts from its fp32 logits x [BLOCK_E] (offs: 0..BLOCK_E - 1; ok: the
    E experts that exist, x -inf past them): TOP_K weights (times scaling) and ids stored at
    weights_ptr and ids_ptr, as the module docstring says, then SHARED more: the shared
    experts stacked after the routed ones (ids E, E + 1, ..., weight 1.0)."""
    if SIGMOID:
        score = tl.where(ok, 1.0 / (1.0 + tl.exp(-x)), 0.0)
        choice = score
        if HAS_BIAS:
            choice += tl.load(bias_ptr + offs, mask=ok, other=0.0)
        choice = tl.where(ok, choice, float("-inf"))
        if N_GROUP > 1:  # keep the TOPK_GROUP groups whose two best are best
            GS: tl.constexpr = BLOCK_E // N_GROUP
            grouped = tl.reshape(choice, (N_GROUP, GS))
            col = tl.arange(0, GS)[None, :]
            first = tl.max(grouped, axis=1)
            at = tl.argmax(grouped, axis=1)
            second = tl.max(tl.where(col == at[:, None], float("-inf"), grouped), axis=1)
            group_score = first + second
            groups = tl.arange(0, N_GROUP)
            keep = groups < 0
            for _ in tl.static_range(TOPK_GROUP):
                best = tl.argmax(group_score, axis=0)
                keep = keep | (groups == best)
                group_score = tl.where(groups == best, float("-inf"), group_score)
            choice = tl.reshape(tl.where(keep[:, None], grouped, float("-inf")), (BLOCK_E,))
    else:
        p = tl.exp(x - tl.max(x, axis=0))
        score = p / tl.sum(p, axis=0)
        choice = tl.where(ok, score, float("-inf"))
    slots = tl.arange(0, TOP_PAD)  # (top_k rounded up to a power of two: DeepSeek-V2's 6)
    weights = tl.zeros((TOP_PAD,), dtype=tl.float32)
    ids = tl.zeros((TOP_PAD,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):  # (one reduction a round: the best and where it is)
        top, best = tl.max(choice, axis=0, return_indices=True)
        if SIGMOID:  # (chosen with the bias, weighted without)
            top = tl.sum(tl.where(offs == best, score, 0.0), axis=0)
        weights = tl.where(slots == j, top, weights)
        ids = tl.where(slots == j, best.to(tl.int64), ids)
        choice = tl.where(offs == best, float("-inf"), choice)
    if RENORMALIZE:
        total = tl.sum(weights, axis=0)
        weights = weights / (total + 1e-20) if SIGMOID else weights / total
    tl.store(weights_ptr + slots, weights * scaling, mask=slots < TOP_K)
    tl.store(ids_ptr + slots, ids, mask=slots < TOP_K)
    for j in tl.static_range(SHARED):
        tl.store(weights_ptr + TOP_K + j, 1.0)
        tl.store(ids_ptr + TOP_K + j, E + j)


def slices(k: int, splits: int, block_k: int) -> tuple[int, int]:
    """(inputs a slice, slices) for k inputs cut into at most `splits` slices of whole
    block_k steps (the last one short)."""
    slice_k = cdiv(cdiv(k, max(1, splits)), block_k) * block_k
    return slice_k, cdiv(k, slice_k)


def route_settings(num_experts: int, top_k: int, scoring: str, renormalize: bool,
                   n_group: int, topk_group: int, has_bias: bool, shared: int = 0
                   ) -> dict | None:
    """The launch settings of a kernel that routes with `choose` (its constexprs and
    num_warps), or None where it cannot: grouping needs the experts to fill BLOCK_E exactly."""
    block_e = next_power_of_2(num_experts)
    grouped = scoring == "sigmoid" and n_group > 1
    if grouped and block_e != num_experts:
        return None
    return dict(TOP_K=top_k, SHARED=shared, TOP_PAD=next_power_of_2(top_k),
                SIGMOID=scoring == "sigmoid",
                HAS_BIAS=has_bias, RENORMALIZE=renormalize, N_GROUP=n_group if grouped else 1,
                TOPK_GROUP=topk_group, BLOCK_E=block_e, num_warps=max(1, min(4, block_e // 256)))


def route_experts(x: torch.Tensor, router: torch.Tensor, correction_bias: torch.Tensor | None,
                  top_k: int, scoring: str, renormalize: bool, n_group: int, topk_group: int,
                  scaling: float, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of torch_ref.route_experts (same arguments and results: weights
    [T, top_k + shared] fp32, ids [T, top_k + shared] int64)."""
    num_tokens, num_experts = x.shape[0], router.shape[0]
    settings = route_settings(num_experts, top_k, scoring, renormalize, n_group, topk_group,
                              correction_bias is not None, shared)
    if settings is None or num_tokens == 0:
        return route_experts_torch(x, router, correction_bias, top_k, scoring, renormalize,
                                   n_group, topk_group, scaling, shared)
    logits = router_logits(x.contiguous(), router.contiguous(),
                           DECODE_SPLITS if num_tokens <= SPLIT_TOKENS else 1)
    weights = torch.empty(num_tokens, top_k + shared, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k + shared, dtype=torch.int64, device=x.device)
    bias = correction_bias if correction_bias is not None else logits
    launch_pdl = pdl(x.device)
    _route[(num_tokens,)](logits, bias, weights, ids, num_tokens, num_experts, float(scaling),
                          SPLITS=logits.shape[0], PDL=launch_pdl, launch_pdl=launch_pdl > 0,
                          **settings)
    return weights, ids
