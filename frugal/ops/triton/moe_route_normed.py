"""A MoE layer's RMSNorm, router logits and routing in one launch, for decode-sized steps.

Before its experts a MoE layer normalizes the residual stream (the experts' input), computes the
router logits from it and chooses each token's experts: three launches (rms_norm, moe_route's
logits and route), each a few µs of a one-token step whatever its bytes. Here program
(expert block, token, slice) computes the token's RMS over its whole row, normalizes its slice
of the row (stored as the experts' input by the programs of expert block 0) and that slice's
partial logits of BLOCK_R experts (stored fp32 [slices, T, E], the partial sums moe_route's
route kernel adds); then takes a ticket from the token's counter (split_k's, zero before and
after), and the last of the token's programs adds the slices' logits up in order and routes the
token (moe_route.choose: the route kernel's code). A program reads the router's slice for one
token and the token's whole row (for its RMS), so the launch reads the router once a token:
up to MAX_TOKENS tokens and ROUTER_READS router values (a few MB from L2: Qwen3-30B-A3B's
128 x 2048 router up to 16 tokens, Kimi K2's 384 x 7168 at one); more, or experts the route
kernel would not take, go through rms_norm and moe_route.route_experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from frugal.ops.triton.elementwise import rms_norm
from frugal.ops.triton.launch import enter, pdl
from frugal.ops.triton.moe_route import DECODE_SPLITS, choose, route_experts, route_settings, slices
from frugal.ops.triton.sizes import cdiv
from frugal.ops.triton.split_k import counters

MAX_TOKENS = 16  # tokens a step routes in one launch (decode-sized steps)
ROUTER_READS = 1 << 22  # tokens x experts x hidden one launch may read at most
BLOCK_R = 16  # experts a program computes the logits of
BLOCK_K = 64  # inputs a step of its loop


@triton.jit(do_not_specialize=["T"])  # (T, the step's tokens, changes from step to step)
def _norm_route(h_ptr, norm_ptr, router_ptr, x_ptr, logits_ptr, bias_ptr, weights_ptr, ids_ptr,
                count_ptr, T, E, K, slice_k, eps, sht, swe, scaling, SPLITS: tl.constexpr,
                TOP_K: tl.constexpr, SHARED: tl.constexpr, TOP_PAD: tl.constexpr,
                SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                N_GROUP: tl.constexpr,
                TOPK_GROUP: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """h [T, K] (rows sht apart) -> x [T, K] = rms_norm(h) · norm (rounded as elementwise's
    kernel rounds it, its squares summed in another order), logits_ptr [SPLITS, T, E] fp32
    partial sums of x @ routerᵀ, and the token's weights / ids [T, TOP_K + SHARED] by the
    last of its programs."""
    enter(PDL)
    block = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    row = h_ptr + t * sht
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(row + ks, mask=ks < K, other=0.0).to(tl.float32)
        squares += v * v
    inv = 1.0 / tl.sqrt(tl.sum(squares, 0) / K + eps)
    experts = block * BLOCK_R + tl.arange(0, BLOCK_R)
    e_ok = experts < E
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(split * slice_k, tl.minimum(K, (split + 1) * slice_k), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        v = tl.load(row + ks, mask=k_ok, other=0.0)
        w = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        x = (w * (v.to(tl.float32) * inv).to(v.dtype).to(tl.float32)).to(
            x_ptr.dtype.element_ty)
        if block == 0:
            tl.store(x_ptr + t * K + ks, x, mask=k_ok)
        r = tl.load(router_ptr + experts[:, None].to(tl.int64) * swe + ks[None, :],
                    mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(r.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(logits_ptr + (split * T + t) * E + experts, acc, mask=e_ok)
    tl.debug_barrier()  # every thread's logits stored before the ticket is taken
    ticket = tl.atomic_add(count_ptr + t, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) * SPLITS - 1:  # (.cg: from L2, never a stale L1 line)
        offs = tl.arange(0, BLOCK_E)
        ok = offs < E
        logits = tl.load(logits_ptr + t * E + offs, mask=ok, other=float("-inf"),
                         cache_modifier=".cg")
        for s in tl.static_range(1, SPLITS):  # (the partial sums in order, as _route adds them)
            logits += tl.load(logits_ptr + (s * T + t) * E + offs, mask=ok, other=0.0,
                              cache_modifier=".cg")
        width = TOP_K + SHARED
        choose(logits, offs, ok, E, bias_ptr, weights_ptr + t * width, ids_ptr + t * width,
               scaling, TOP_K, SHARED, TOP_PAD, SIGMOID, HAS_BIAS, RENORMALIZE, N_GROUP,
               TOPK_GROUP, BLOCK_E)
        tl.store(count_ptr + t, 0)


def norm_route_experts(h: torch.Tensor, norm: torch.Tensor, eps: float, router: torch.Tensor,
                       correction_bias: torch.Tensor | None, top_k: int, scoring: str,
                       renormalize: bool, n_group: int, topk_group: int, scaling: float,
                       shared: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The twin of torch_ref.norm_route_experts: (x = rms_norm(h, norm, eps) [T, hidden] in h's
    dtype, weights [T, top_k + shared] fp32, ids [T, top_k + shared] int64)."""
    num_tokens, hidden = h.shape
    num_experts = router.shape[0]
    settings = route_settings(num_experts, top_k, scoring, renormalize, n_group, topk_group,
                              correction_bias is not None, shared)
    if (settings is None or not 0 < num_tokens <= MAX_TOKENS
            or num_tokens * num_experts * hidden > ROUTER_READS
            or h.stride(-1) != 1 or router.stride(-1) != 1 or norm.stride(-1) != 1):
        x = rms_norm(h, norm, eps)
        return (x, *route_experts(x, router, correction_bias, top_k, scoring, renormalize,
                                  n_group, topk_group, scaling, shared))
    slice_k, splits = slices(hidden, DECODE_SPLITS, BLOCK_K)
    x = torch.empty(num_tokens, hidden, dtype=h.dtype, device=h.device)
    logits = torch.empty(splits, num_tokens, num_experts, dtype=torch.float32, device=h.device)
    weights = torch.empty(num_tokens, top_k + shared, dtype=torch.float32, device=h.device)
    ids = torch.empty(num_tokens, top_k + shared, dtype=torch.int64, device=h.device)
    launch_pdl = pdl(h.device)
    _norm_route[(cdiv(num_experts, BLOCK_R), num_tokens, splits)](
        h, norm, router, x, logits, correction_bias if correction_bias is not None else logits,
        weights, ids, counters(h.device), num_tokens, num_experts, hidden, slice_k, eps,
        h.stride(0), router.stride(0), float(scaling), SPLITS=splits, BLOCK_R=BLOCK_R,
        BLOCK_K=BLOCK_K, PDL=launch_pdl, launch_pdl=launch_pdl > 0, **settings)
    return x, weights, ids
