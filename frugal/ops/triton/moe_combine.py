"""The last step of a fused MoE layer: each token's top_k expert outputs (and the residual)
summed in fp32 and rounded once, in a fixed order: one launch (`combine`), or in the epilogue
of a down projection that computes a slot a program (`sum_token`: the last of a token's slots
to finish adds them up, as split-K's last split does)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from frugal.ops.triton.launch import enter, pdl
from frugal.ops.triton.sizes import cdiv, next_power_of_2
from frugal.ops.triton.split_k import MAX_BLOCKS

BLOCK, NUM_WARPS = 1024, 4  # combine's outputs a program and its warps


@triton.jit
def _combine(out_ptr, res_ptr, dst_ptr, H, TOP_K: tl.constexpr, RESIDUAL: tl.constexpr,
             BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # (a fixed order: results do not depend on scheduling)
        acc += tl.load(out_ptr + (t * TOP_K + j) * H + cols, mask=ok, other=0.0).to(tl.float32)
    if RESIDUAL:
        acc += tl.load(res_ptr + t * H + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(dst_ptr + t * H + cols, acc.to(dst_ptr.dtype.element_ty), mask=ok)


@triton.jit
def sum_token(y, slot, offs_n, n_ok, H, block, n_blocks, out_ptr, res_ptr, dst_ptr, count_ptr,
              TOP_K: tl.constexpr, RESIDUAL: tl.constexpr):
    """A down projection's epilogue that does _combine's work: y, this program's fp32 outputs
    [BLOCK_N] (offs_n of H; routing-weighted) of slot `slot` (a scalar), stored in out_ptr
    [slots, H] fp32; then a ticket from the counter of (the slot's token, output block `block`
    of n_blocks) (count_ptr, zero before and after); the last of the token's TOP_K slots to
    arrive adds their rows up in slot order and the residual, as _combine does (the same fp32
    sums), into dst_ptr [tokens, H], and resets the counter."""
    token = slot // TOP_K
    tl.store(out_ptr + slot.to(tl.int64) * H + offs_n, y, mask=n_ok)
    tl.debug_barrier()  # every thread's row stored before the ticket is taken
    counter = count_ptr + token * n_blocks + block
    ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if ticket == TOP_K - 1:  # (.cg: from L2, never a stale L1 line)
        first = out_ptr + (token * TOP_K).to(tl.int64) * H + offs_n
        acc = tl.load(first, mask=n_ok, other=0.0, cache_modifier=".cg")
        for j in tl.static_range(1, TOP_K):
            acc += tl.load(first + j * H, mask=n_ok, other=0.0, cache_modifier=".cg")
        if RESIDUAL:
            acc += tl.load(res_ptr + token.to(tl.int64) * H + offs_n, mask=n_ok,
                           other=0.0).to(tl.float32)
        tl.store(dst_ptr + token.to(tl.int64) * H + offs_n, acc.to(dst_ptr.dtype.element_ty),
                 mask=n_ok)
        tl.store(counter, 0)


def sums_tokens(tokens: int, n_blocks: int) -> bool:
    """Whether a launch of n_blocks output blocks over tokens' slots can `sum_token` (a counter
    for each token and block)."""
    return 0 < tokens * n_blocks <= MAX_BLOCKS


def token_sums(sums: tuple | None, out: torch.Tensor, n: int, n_blocks: int,
               routed: bool) -> tuple:
    """What a down launch passes its kernel for `sum_token`: sums (dst, residual or None,
    top_k) where the launch can take them (routed, into an fp32 out [slots, n] whose rows are n
    apart, a counter for each token and output block), else (out, None, 0): no sums."""
    if sums is None or not routed or out.dtype != torch.float32 or out.stride(0) != n:
        return out, None, 0
    return sums if sums_tokens(out.shape[0] // sums[2], n_blocks) else (out, None, 0)


def summed(down, x: torch.Tensor, top_k: int, residual: torch.Tensor | None) -> torch.Tensor:
    """Each token's top_k slot outputs of `down(out, sums)` (a down launch into out [tokens ·
    top_k, hidden] fp32, returning whether it summed them as sums = (dst, residual, top_k)
    asks) plus the residual: [tokens, hidden] in the dtype of x [tokens, hidden], summed by the
    launch where it can, else by `combine`."""
    tokens, hidden = x.shape
    out = torch.empty(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    dst = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if residual is not None:
        residual = residual.contiguous()
    if down(out, (dst, residual, top_k)):
        return dst
    return combine(out, top_k, residual, x.dtype)


def combine(out: torch.Tensor, top_k: int, residual: torch.Tensor | None,
            dtype: torch.dtype) -> torch.Tensor:
    """Each token's top_k slot outputs (out [tokens · top_k, hidden], a token's slots
    together) summed in fp32, plus residual [tokens, hidden] if given, rounded once to dtype:
    one launch."""
    slots, hidden = out.shape
    dst = torch.empty(slots // top_k, hidden, dtype=dtype, device=out.device)
    if slots == 0:
        return dst
    if residual is not None:
        residual = residual.contiguous()
    block = min(BLOCK, next_power_of_2(hidden))
    launch_pdl = pdl(out.device)
    _combine[(slots // top_k, cdiv(hidden, block))](
        out, residual if residual is not None else out, dst, hidden, TOP_K=top_k,
        RESIDUAL=residual is not None, BLOCK=block, PDL=launch_pdl, num_warps=NUM_WARPS,
        launch_pdl=launch_pdl > 0)
    return dst
