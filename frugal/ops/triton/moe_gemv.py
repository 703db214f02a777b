"""Mixture of experts for a few tokens: each (token, expert) slot reads its expert's matrix once,
with no sorting of slots by expert and no padding (the align step and its ~10 small kernels
cost more than the matmuls at decode batch sizes).

Grid (slots, cdiv(N, BLOCK_N)): a program multiplies its slot's input row by a [BLOCK_N, K]
slice of its expert's matrix, widened in registers (float, FP8 blocks or per channel, INT4
group-wise: the forms of ops.triton.moe's MODE), accumulating in fp32 on the CUDA cores (one
row: no tensor-core tile to fill). Narrow slices give every SM work at one token (8 slots of a
2,048-wide down projection: 512 programs). gate_up runs GATED: the gate and up slices of the
same outputs side by side, silu(gate) · up stored per slot; down runs ROUTED: each slot's output
times its routing weight, the top_k of a token summed in fp32 after (in a fixed order: results
do not depend on scheduling). A weight is read once per slot: two tokens routed to one expert
read it twice (the sorted path, ops.triton.moe, reads it once; it takes over past MAX_SLOTS).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from frugal.ops.triton.moe import _operand, _weight_tile, combine, int4_nibble, int4_words
from frugal.ops.triton.moe_configs import lookup, tiles_scales
from frugal.quant.experts import Experts

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_SLOTS = 64  # tokens · top_k up to which fused_moe takes this path


@triton.jit
def _int4_partial(w_base, s_base, a_row, word, w_ok, offs_n, n_ok, swn, swk, ssn, ssk,
                  S_BK: tl.constexpr, WORDS: tl.constexpr, BLOCK_N: tl.constexpr):
    """[WORDS, BLOCK_N] fp32: for each word of 8 INT4 inputs (k = 8 · word + j) and output,
    Σ_j (u_j - 8) · a[k], times the word's group scale (the caller sums over words once)."""
    words, s = int4_words(w_base, s_base, word, w_ok, offs_n, n_ok, swn, swk, ssn, ssk, S_BK)
    part = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(8):
        a = tl.load(a_row + word * 8 + j, mask=w_ok, other=0.0).to(tl.float32)
        part += int4_nibble(words, j) * a[:, None]
    return part * s


@triton.jit
def _gemv(a_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, route_ptr, N, K, sam, swe, swn, swk, sse, ssn,
          ssk, som, A_DIV: tl.constexpr, MODE: tl.constexpr, S_BN: tl.constexpr,
          S_BK: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):
    slot = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # (int64: an expert's offset passes 2**31 elements in Kimi K2's and GLM-5's stacks)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    a_row = a_ptr + (slot // A_DIV).to(tl.int64) * sam
    if MODE == 2:  # INT4: per-word partial sums, summed over words once after the loop
        WORDS: tl.constexpr = BLOCK_K // 8
        acc2 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        up2 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        w_base, s_base = w_ptr + expert * swe, s_ptr + expert * sse
        for k0 in range(0, K, BLOCK_K):
            word = k0 // 8 + tl.arange(0, WORDS)
            w_ok = word < K // 8
            acc2 += _int4_partial(w_base, s_base, a_row, word, w_ok, offs_n, n_ok, swn, swk,
                                  ssn, ssk, S_BK, WORDS, BLOCK_N)
            if GATED:
                up2 += _int4_partial(w_base, s_base, a_row, word, w_ok, offs_n + N, n_ok, swn,
                                     swk, ssn, ssk, S_BK, WORDS, BLOCK_N)
        acc = tl.sum(acc2, axis=0)
        acc_up = tl.sum(up2, axis=0)
    else:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_row + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            w = _weight_tile(w_ptr, s_ptr, expert, k0, K, offs_n, n_ok, swe, swn, swk, sse,
                             ssn, ssk, MODE, S_BN, S_BK, BLOCK_K, BLOCK_N)
            acc += tl.sum(w.to(tl.float32) * a[:, None], axis=0)
            if GATED:
                w = _weight_tile(w_ptr, s_ptr, expert, k0, K, offs_n + N, n_ok, swe, swn, swk,
                                 sse, ssn, ssk, MODE, S_BN, S_BK, BLOCK_K, BLOCK_N)
                acc_up += tl.sum(w.to(tl.float32) * a[:, None], axis=0)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    else:  # routed: times the slot's routing weight
        acc = acc * tl.load(route_ptr + slot)
    tl.store(out_ptr + slot.to(tl.int64) * som + offs_n, acc.to(out_ptr.dtype.element_ty),
             mask=n_ok)


def _blocks(mode: int, s_bk: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): a [BLOCK_K, BLOCK_N] tile of ~16 KB of weights a loop step; a
    quantized tile stays within one scale's inputs or holds whole groups of them (see
    moe._weight_tile)."""
    if _INTERPRET:
        block_n, block_k = 16, 32
    else:
        block_n, block_k = 32, 256 if mode != 0 else 128
    if not tiles_scales(mode, block_k, s_bk, k):
        raise ValueError(f"fused_moe: scales over {s_bk} inputs need a power of two")
    return block_n, block_k


def _launch(a: torch.Tensor, w: torch.Tensor | Experts, out: torch.Tensor, n: int,
            ids: torch.Tensor, route: torch.Tensor | None, a_div: int,
            config: dict | None = None) -> None:
    """out[slot] = a[slot // a_div] @ w[ids[slot]]ᵀ, gated (route None) or times route[slot].
    config: BLOCK_N, BLOCK_K, num_warps (default: the tuned table's, ops.triton.moe_configs,
    else _blocks')."""
    data, scales, mode, s_bn, s_bk, k = _operand(w)
    config = config or lookup(a.device, "gemv", mode, n, k, ids.numel(), s_bk)
    if config is None:
        block_n, block_k = _blocks(mode, s_bk, k)
        num_warps = 4
    else:
        block_n, block_k, num_warps = config["BLOCK_N"], config["BLOCK_K"], config["num_warps"]
    grid = (ids.numel(), triton.cdiv(n, block_n))
    _gemv[grid](a, data, scales, out, ids, route if route is not None else out, n, k,
                a.stride(0), *data.stride(), *scales.stride(), out.stride(0), A_DIV=a_div,
                MODE=mode, S_BN=s_bn, S_BK=s_bk, GATED=route is None, BLOCK_N=block_n,
                BLOCK_K=block_k, num_warps=num_warps)


def fused_moe_gemv(x: torch.Tensor, gate_up: torch.Tensor | Experts,
                   down: torch.Tensor | Experts, weights: torch.Tensor,
                   ids: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """ops.triton.moe.fused_moe for tokens · top_k ≤ MAX_SLOTS (same arguments and result)."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    inter = down.shape[2]
    flat = ids.reshape(-1).contiguous()
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    _launch(x, gate_up, act, inter, flat, None, top_k)
    out = torch.empty(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    _launch(act, down, out, hidden, flat, weights.reshape(-1).float().contiguous(), 1)
    return combine(out, top_k, residual, x.dtype)
