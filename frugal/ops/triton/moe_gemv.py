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
Two ways to keep more bytes in flight a warp, each a tile table's choice (off by default): STAGES
2-4 has Triton software-pipeline the K loop (compiled for sm_90: the weight tiles copied into
shared memory by cp.async, STAGES - 1 steps ahead; every form); PREFETCH 1 or 2 (INT4) loads the
words and scales of the K step 1 or 2 ahead into registers before it sums this step's
(benchmarks/moe_sass.py --stages, --prefetch: their instructions and registers).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from frugal.ops.triton.fp8_groups import round_inputs
from frugal.ops.triton.launch import enter, pdl
from frugal.ops.triton.moe import ONE_BITS, _operand, _weight_tile, kernel_mode
from frugal.ops.triton.moe_combine import sum_token, summed, token_sums
from frugal.ops.triton.moe_configs import gemv_tile, lookup, tiles_scales
from frugal.ops.triton.moe_gemv_int4 import int4_inputs, int4_load, int4_pair, int4_sum
from frugal.ops.triton.moe_int4_tiles import Int4ExpertTiles
from frugal.ops.triton.sizes import cdiv
from frugal.ops.triton.split_k import counters
from frugal.quant.experts import Experts, Int4Experts

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_SLOTS = 64  # tokens · top_k up to which fused_moe takes this path


@triton.jit
def _fp8_sum(w_ptr, s_ptr, expert, k0, K, a, offs_n, n_ok, swe, swn, swk, sse, ssn, ssk,
             S_BN: tl.constexpr, S_BK: tl.constexpr, BLOCK_K: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """[BLOCK_N] fp32: Σ_k a_k · w[n, k] over inputs k0 .. k0 + BLOCK_K of FP8 weights, each
    scale applied once to its inputs' sum rather than to every weight. a [BLOCK_K] fp32."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + expert * swe + offs_n[None, :] * swn + offs_k[:, None] * swk,
                mask=(offs_k[:, None] < K) & n_ok[None, :], other=0.0).to(tl.float32)
    if S_BK < BLOCK_K:  # whole scale blocks: a sum per block, then its scale
        GROUPS: tl.constexpr = BLOCK_K // S_BK
        part = tl.sum(tl.reshape(w * a[:, None], (GROUPS, S_BK, BLOCK_N)), axis=1)
        group = k0 // S_BK + tl.arange(0, GROUPS)
        s = tl.load(s_ptr + expert * sse + (offs_n // S_BN)[None, :] * ssn
                    + group[:, None] * ssk, mask=(group[:, None] * S_BK < K) & n_ok[None, :],
                    other=0.0)
        return tl.sum(part * s, axis=0)
    s = tl.load(s_ptr + expert * sse + (offs_n // S_BN) * ssn + (k0 // S_BK) * ssk,
                mask=n_ok, other=0.0)
    return tl.sum(w * a[:, None], axis=0) * s


@triton.jit
def _gemv(a_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, route_ptr, res_ptr, dst_ptr, count_ptr, N, K,
          sam, swe, swn, swk, sse, ssn, ssk, som, magic, A_DIV: tl.constexpr, MODE: tl.constexpr,
          S_BN: tl.constexpr, S_BK: tl.constexpr, GATED: tl.constexpr,
          FP8_SCALES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PREFETCH: tl.constexpr, STAGES: tl.constexpr, A_FP8: tl.constexpr,
          TOP_K: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    """out[slot, offs_n] = a[slot // A_DIV] @ w[ids[slot]]ᵀ, silu(gate) · up if GATED, else
    times route[slot]; TOP_K > 0 (routed, out fp32 [slots, N]): and each token's TOP_K slots
    (and res_ptr's row if RESIDUAL) summed into dst_ptr (moe_combine.sum_token)."""
    enter(PDL)
    slot = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # (int64: an expert's offset passes 2**31 elements in Kimi K2's and GLM-5's stacks)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    a_row = a_ptr + (slot // A_DIV).to(tl.int64) * sam
    if MODE == 2:  # INT4: per-group partial sums, summed over groups once after the loop
        GROUPS: tl.constexpr = BLOCK_K // 32
        acc2 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
        up2 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
        w_base, s_base = w_ptr + expert * swe, s_ptr + expert * sse
        tl.static_assert(PREFETCH >= 0 and PREFETCH <= 2)
        if PREFETCH:  # the words and scales PREFETCH steps ahead load while this step sums
            w, s, w_up, s_up = int4_pair(w_base, s_base, 0, K, N, offs_n, n_ok, swn, swk, ssn,
                                         ssk, S_BK, GROUPS, GATED)
            if PREFETCH == 2:
                w1, s1, w1_up, s1_up = int4_pair(w_base, s_base, BLOCK_K, K, N, offs_n, n_ok,
                                                 swn, swk, ssn, ssk, S_BK, GROUPS, GATED)
            for k0 in range(0, K, BLOCK_K):
                a, a_sum = int4_inputs(a_row, k0, K, GROUPS)
                wn, sn, wn_up, sn_up = int4_pair(w_base, s_base, k0 + PREFETCH * BLOCK_K, K, N,
                                                 offs_n, n_ok, swn, swk, ssn, ssk, S_BK,
                                                 GROUPS, GATED)
                acc2 += int4_sum(w, s, a, a_sum, magic)
                if GATED:
                    up2 += int4_sum(w_up, s_up, a, a_sum, magic)
                if PREFETCH == 2:
                    w, s, w_up, s_up = w1, s1, w1_up, s1_up
                    w1, s1, w1_up, s1_up = wn, sn, wn_up, sn_up
                else:
                    w, s, w_up, s_up = wn, sn, wn_up, sn_up
        else:
            for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
                a, a_sum = int4_inputs(a_row, k0, K, GROUPS)
                w, s = int4_load(w_base, s_base, k0, K, offs_n, n_ok, swn, swk, ssn, ssk, S_BK,
                                 GROUPS)
                acc2 += int4_sum(w, s, a, a_sum, magic)
                if GATED:
                    w, s = int4_load(w_base, s_base, k0, K, offs_n + N, n_ok, swn, swk, ssn,
                                     ssk, S_BK, GROUPS)
                    up2 += int4_sum(w, s, a, a_sum, magic)
        acc = tl.sum(acc2, axis=1) * 16.0
        acc_up = tl.sum(up2, axis=1) * 16.0
    else:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
        IN_PLACE: tl.constexpr = MODE == 0 or FP8_SCALES != 0
        # (VEC: the inputs a thread loads at once, 16 bytes; summed before they accumulate)
        VEC: tl.constexpr = 128 // w_ptr.dtype.element_ty.primitive_bitwidth
        acc2 = tl.zeros((BLOCK_K // VEC if IN_PLACE else 1, BLOCK_N), dtype=tl.float32)
        up2 = tl.zeros((BLOCK_K // VEC if IN_PLACE else 1, BLOCK_N), dtype=tl.float32)
        s_base = s_ptr + expert * sse  # (FP8_SCALES 1: the tile's rows share a scale block)
        s_row = s_base + (tl.program_id(1) * BLOCK_N // S_BN) * ssn
        s_row_up = s_base + ((tl.program_id(1) * BLOCK_N + N) // S_BN) * ssn
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_row + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            if A_FP8:  # W8A8 experts: the inputs as FP8 per 128 (BLOCK_K a multiple of it)
                a = round_inputs(a, BLOCK_K)
            if IN_PLACE:  # products summed in place, across threads once after the loop
                a_up = a  # (the up half's rows, N on: read only GATED)
                if FP8_SCALES == 1 and BLOCK_K <= S_BK:  # the scale of the inputs' block
                    if GATED:
                        a_up = a * tl.load(s_row_up + (k0 // S_BK) * ssk)
                    a = a * tl.load(s_row + (k0 // S_BK) * ssk)
                elif FP8_SCALES == 1:  # the scales of the inputs' blocks, on the inputs
                    if GATED:
                        a_up = a * tl.load(s_row_up + (offs_k // S_BK) * ssk,
                                           mask=offs_k < K, other=0.0)
                    a = a * tl.load(s_row + (offs_k // S_BK) * ssk, mask=offs_k < K, other=0.0)
                w = _weight_tile(w_ptr, s_ptr, expert, k0, K, offs_n, n_ok, swe, swn, swk,
                                 sse, ssn, ssk, 0, S_BN, S_BK, BLOCK_K, BLOCK_N)
                acc2 += tl.sum(tl.reshape(w.to(tl.float32) * a[:, None],
                                          (BLOCK_K // VEC, VEC, BLOCK_N)), axis=1)
                if GATED:
                    w = _weight_tile(w_ptr, s_ptr, expert, k0, K, offs_n + N, n_ok, swe, swn,
                                     swk, sse, ssn, ssk, 0, S_BN, S_BK, BLOCK_K, BLOCK_N)
                    up2 += tl.sum(tl.reshape(w.to(tl.float32) * a_up[:, None],
                                             (BLOCK_K // VEC, VEC, BLOCK_N)), axis=1)
            else:  # FP8 blocks a tile's rows straddle: a sum per block, then its scale
                acc += _fp8_sum(w_ptr, s_ptr, expert, k0, K, a, offs_n, n_ok, swe, swn, swk,
                                sse, ssn, ssk, S_BN, S_BK, BLOCK_K, BLOCK_N)
                if GATED:
                    acc_up += _fp8_sum(w_ptr, s_ptr, expert, k0, K, a, offs_n + N, n_ok, swe,
                                       swn, swk, sse, ssn, ssk, S_BN, S_BK, BLOCK_K, BLOCK_N)
        if IN_PLACE:
            acc = tl.sum(acc2, axis=0)
            acc_up = tl.sum(up2, axis=0)
        if FP8_SCALES == 2:  # one scale per output: after the sum
            acc *= tl.load(s_base + offs_n * ssn, mask=n_ok, other=0.0)
            if GATED:
                acc_up *= tl.load(s_base + (offs_n + N) * ssn, mask=n_ok, other=0.0)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    else:  # routed: times the slot's routing weight
        acc = acc * tl.load(route_ptr + slot)
    if TOP_K:
        sum_token(acc, slot, offs_n, n_ok, N, tl.program_id(1), tl.num_programs(1), out_ptr,
                  res_ptr, dst_ptr, count_ptr, TOP_K, RESIDUAL)
    else:
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
    if mode == 3:  # (W8A8: its inputs round per 128)
        block_k = max(block_k, 128)
    if not tiles_scales(mode, block_k, s_bk, k):
        raise ValueError(f"fused_moe: scales over {s_bk} inputs need a power of two")
    return block_n, block_k


def takes(w: torch.Tensor | Experts) -> bool:
    """Whether this path takes w: any float or FP8 form; INT4 with groups of a multiple of 32
    inputs (its partial sums are per 32 inputs); not INT4 experts repacked for moe_int4_wgmma
    (which runs those at every size)."""
    if isinstance(w, Int4ExpertTiles):
        return False
    return not isinstance(w, Int4Experts) or (w.group_size % 32 == 0 and w.shape[2] % 32 == 0)


def _launch(a: torch.Tensor, w: torch.Tensor | Experts, out: torch.Tensor, n: int,
            ids: torch.Tensor, route: torch.Tensor | None, a_div: int,
            config: dict | None = None, sums: tuple | None = None) -> bool:
    """out[slot] = a[slot // a_div] @ w[ids[slot]]ᵀ, gated (route None) or times route[slot].
    config: BLOCK_N, BLOCK_K, num_warps and optionally PREFETCH (INT4: the K steps loaded
    ahead, 0-2; default 0) and STAGES (1-4, default 1; one with PREFETCH) (default: the tuned
    table's, ops.triton.moe_configs, else _blocks'). sums (routed, out fp32): (dst [tokens, n],
    residual or None, top_k), each token's slots summed into dst by the launch where it can
    (moe_combine.token_sums); returns whether it did."""
    data, scales, mode, s_bn, s_bk, k = _operand(w)
    config = config or lookup(a.device, "gemv", mode, n, k, ids.numel(), s_bk)
    if config is not None and not gemv_tile(mode, config["BLOCK_K"]):
        config = None  # (one given here is checked as the table's are)
    if config is None:
        block_n, block_k = _blocks(mode, s_bk, k)
        num_warps = 4
    else:
        block_n, block_k, num_warps = config["BLOCK_N"], config["BLOCK_K"], config["num_warps"]
    w8a8, mode = mode == 3, kernel_mode(mode)  # (W8A8: FP8's kernel, its inputs rounded)
    prefetch, stages = loop_options(mode, config or {})
    grid = (ids.numel(), cdiv(n, block_n))
    dst, residual, top_k = token_sums(sums, out, n, grid[1], route is not None)
    launch_pdl = pdl(a.device)
    _gemv[grid](a, data, scales, out, ids, route if route is not None else out,
                residual if residual is not None else out, dst, counters(a.device), n, k,
                a.stride(0), *data.stride(), *scales.stride(), out.stride(0), ONE_BITS,
                A_DIV=a_div, MODE=mode, S_BN=s_bn, S_BK=s_bk, GATED=route is None, A_FP8=w8a8,
                FP8_SCALES=_fp8_scales(mode, s_bn, s_bk, n, k, block_n), BLOCK_N=block_n,
                BLOCK_K=block_k, PREFETCH=prefetch, STAGES=stages, TOP_K=top_k,
                RESIDUAL=residual is not None, PDL=launch_pdl, num_warps=num_warps,
                launch_pdl=launch_pdl > 0)
    return top_k > 0


def loop_options(mode: int, config: dict) -> tuple[int, int]:
    """(PREFETCH, STAGES) of _gemv for a configuration: PREFETCH for INT4 only (else 0), STAGES
    1 beside it."""
    prefetch = config.get("PREFETCH", 0) if mode == 2 else 0
    return prefetch, 1 if prefetch else config.get("STAGES", 1)


def _fp8_scales(mode: int, s_bn: int, s_bk: int, n: int, k: int, block_n: int) -> int:
    """How _gemv applies FP8 scales: 2 one per output (per channel), after the sum; 1 on the
    inputs, when a tile's rows (gate and up alike) lie in one block of S_BN rows; 0 to each
    block's partial sum."""
    if mode != 1:
        return 0
    if s_bn == 1 and s_bk >= k:
        return 2
    return 1 if s_bn % block_n == 0 and n % s_bn == 0 else 0


def fused_moe_gemv(x: torch.Tensor, gate_up: torch.Tensor | Experts,
                   down: torch.Tensor | Experts, weights: torch.Tensor,
                   ids: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """ops.triton.moe.fused_moe for tokens · top_k ≤ MAX_SLOTS and weights it `takes` (same
    arguments and result)."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    inter = down.shape[2]
    flat = ids.reshape(-1).contiguous()
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    _launch(x, gate_up, act, inter, flat, None, top_k)
    route = weights.reshape(-1).float().contiguous()
    return summed(lambda out, sums: _launch(act, down, out, hidden, flat, route, 1, sums=sums),
                  x, top_k, residual)
