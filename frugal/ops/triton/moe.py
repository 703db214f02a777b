"""Fused mixture of experts: tokens sorted by expert, then one grouped GEMM per matrix.

`align` (moe_align.py) lays each token's expert slots out expert by expert, every expert's run
padded to a multiple of BLOCK_M, so one block of rows belongs to one expert (vLLM's
moe_align_block_size).
Slot s = t · top_k + j is token t's j-th expert. All shapes depend only on the number of tokens,
so a CUDA graph captures the whole layer: padding slots hold the sentinel S = num_slots and
blocks past the padded total exit at once.

`_sorted_gemm` multiplies a block of rows (gathered through the sorted slots) by its expert's
matrix, with the expert weights in one of three forms, widened in registers:
  MODE 0  float [E, N, K] (the activations' dtype);
  MODE 1  FP8 e4m3 [E, N, K] with fp32 scales per (N / S_BN, K / S_BK) tile (128×128 blocks,
          or per channel: S_BN 1, S_BK K);
  MODE 2  INT4 [E, N, K / 8] int32 words (compressed-tensors packing, symmetric: w = (u - 8) ·
          scale) with scales per (row, K / S_BK group);
  MODE 1 with A_FP8 (W8A8 experts, moe_configs' mode 3): the activations rounded to e4m3 per
          row and 128 inputs (fp8_groups: in registers, A_FP8 1; once before, 2, for blocks of
          64 rows or more) and multiplied with the weights as stored on FP8 tensor cores, a
          group's products scaled once.
gate_up runs GATED: the gate and up tiles of the same outputs (rows n and n + N of the
expert's matrix) accumulate side by side and the block stores silu(gate) · up, per slot. down
runs ROUTED: each slot's output times its routing weight. The top_k outputs of a token are
summed in fp32 after. INT4 experts at prompt sizes are dequantized a chunk at a time and
multiplied as MODE 0 (moe_dense), each chunk's blocks alone (experts first .. last - 1).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from frugal.ops.triton import fp8_groups, moe_dense, moe_int4_wgmma
from frugal.ops.triton.fp8_groups import quantize_group, w8a8_step
from frugal.ops.triton.launch import enter, pdl
from frugal.ops.triton.moe_align import align
from frugal.ops.triton.moe_combine import combine
from frugal.ops.triton.moe_configs import lookup, w8a8_tile
from frugal.ops.triton.moe_int4 import ONE_BITS, int4_gemm
from frugal.ops.triton.moe_int4_tiles import Int4ExpertTiles
from frugal.ops.triton.sizes import cdiv
from frugal.quant.experts import Experts, Fp8Experts, Int4Experts

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _weight_tile(w_ptr, s_ptr, expert, k0, K, offs_n, n_ok, swe, swn, swk, sse, ssn, ssk,
                 MODE: tl.constexpr, S_BN: tl.constexpr, S_BK: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The expert's weight as a [BLOCK_K, BLOCK_N] tile (wᵀ) from input k0 on, widened to fp32
    if quantized. A tile lies within one scale's inputs (S_BK a multiple of BLOCK_K, or ≥ K:
    one scale per output), or holds whole groups of them (BLOCK_K a multiple of S_BK: a
    [BLOCK_K / S_BK, BLOCK_N] tile of scales, so INT4's groups of 32 do not cut the K step to
    32)."""
    if MODE == 2:  # a [BLOCK_K / 8, BLOCK_N] tile of words, each unpacked into 8 inputs
        word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_ptr + expert * swe + offs_n[None, :] * swn + word[:, None] * swk,
                        mask=(word[:, None] < K // 8) & n_ok[None, :], other=0)
        shifts = tl.arange(0, 8) * 4
        u = (words[:, None, :] >> shifts[None, :, None]) & 0xF
        w = tl.reshape(u - 8, (BLOCK_K, BLOCK_N)).to(tl.float32)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + expert * swe + offs_n[None, :] * swn + offs_k[:, None] * swk,
                    mask=(offs_k[:, None] < K) & n_ok[None, :], other=0.0)
    if MODE != 0 and S_BK < BLOCK_K:  # whole groups: one scale per group and output
        GROUPS: tl.constexpr = BLOCK_K // S_BK
        group = k0 // S_BK + tl.arange(0, GROUPS)
        s = tl.load(s_ptr + expert * sse + (offs_n // S_BN)[None, :] * ssn + group[:, None] * ssk,
                    mask=(group[:, None] * S_BK < K) & n_ok[None, :], other=0.0)
        w = tl.reshape(tl.reshape(w.to(tl.float32), (GROUPS, S_BK, BLOCK_N)) * s[:, None, :],
                       (BLOCK_K, BLOCK_N))
    elif MODE != 0:
        s = tl.load(s_ptr + expert * sse + (offs_n // S_BN) * ssn + (k0 // S_BK) * ssk,
                    mask=n_ok, other=0.0)
        w = w.to(tl.float32) * s[None, :]
    return w


@triton.jit
def _dot(a, w, acc, F32_DOT: tl.constexpr):
    if F32_DOT:  # fp32 activations, and the interpreter (whose bf16 dot is wrong): exact fp32
        return acc + tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return acc + tl.dot(a, w.to(a.dtype))


# (num_slots changes from step to step; first and last, an expert range, from chunk to chunk)
@triton.jit(do_not_specialize=["num_slots", "first", "last"])
def _sorted_gemm(a_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, block_expert_ptr, total_ptr, route_ptr,
                 as_ptr, N, K, num_slots, first, last, sam, swe, swn, swk, sse, ssn, ssk, som,
                 sas, magic,
                 A_DIV: tl.constexpr, MODE: tl.constexpr, S_BN: tl.constexpr, S_BK: tl.constexpr,
                 GATED: tl.constexpr, ROUTED: tl.constexpr, F32_DOT: tl.constexpr,
                 A_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    # (int64: an expert's offset passes 2**31 elements in Kimi K2's and GLM-5's stacks)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if (expert < first) | (expert >= last):  # (another chunk's: w holds experts first..last-1)
        return
    expert -= first
    slot = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = slot < num_slots
    a_row = (slot // A_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MODE == 2 and BLOCK_K >= 128:  # INT4, 16 words or more a step (moe_int4)
        acc, acc_up = int4_gemm(a_ptr + a_row[:, None] * sam, row_ok, w_ptr + expert * swe,
                                s_ptr + expert * sse, offs_n, n_ok, N, K, swn, swk, ssn, ssk,
                                magic, GATED, S_BK, F32_DOT, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            a = tl.load(a_ptr + a_row[:, None] * sam + offs_k[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if A_FP8:  # (BLOCK_K 128: one group of inputs a step)
                if A_FP8 == 2:  # a: the codes, as_ptr: their scales (fp8_groups.quantize)
                    q = a
                    s_a = tl.load(as_ptr + a_row * sas + k0 // 128, mask=row_ok, other=0.0)
                else:  # rounded here
                    q, s_a = quantize_group(a.to(tl.float32))
                acc = w8a8_step(q, s_a, w_ptr, s_ptr, expert, k0, offs_k, k_ok, offs_n, n_ok,
                                 swe, swn, swk, sse, ssn, ssk, acc, S_BN, S_BK, F32_DOT)
                if GATED:
                    acc_up = w8a8_step(q, s_a, w_ptr, s_ptr, expert, k0, offs_k, k_ok,
                                        offs_n + N, n_ok, swe, swn, swk, sse, ssn, ssk, acc_up,
                                        S_BN, S_BK, F32_DOT)
            else:
                w = _weight_tile(w_ptr, s_ptr, expert, k0, K, offs_n, n_ok, swe, swn, swk, sse,
                                 ssn, ssk, MODE, S_BN, S_BK, BLOCK_K, BLOCK_N)
                acc = _dot(a, w, acc, F32_DOT)
                if GATED:
                    w = _weight_tile(w_ptr, s_ptr, expert, k0, K, offs_n + N, n_ok, swe, swn,
                                     swk, sse, ssn, ssk, MODE, S_BN, S_BK, BLOCK_K, BLOCK_N)
                    acc_up = _dot(a, w, acc_up, F32_DOT)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if ROUTED:
        acc = acc * tl.load(route_ptr + slot, mask=row_ok, other=0.0)[:, None]
    tl.store(out_ptr + slot.to(tl.int64)[:, None] * som + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _operand(w: torch.Tensor | Experts) -> tuple:
    """(tensor, scales, mode, S_BN, S_BK, K) of a stacked expert weight; mode: the kernels'
    MODE, 3 for W8A8 FP8 experts (MODE 1 with A_FP8; their own tiles in moe_configs)."""
    if isinstance(w, Fp8Experts):
        k = w.shape[2]
        block = (w.block, w.block) if w.block is not None else (1, k)
        return w.data, w.scales, 3 if w.w8a8 else 1, *block, k
    if isinstance(w, Int4Experts):
        return w.packed, w.scales, 2, 1, w.group_size, w.shape[2]
    if isinstance(w, Int4ExpertTiles):
        return w.words, w.params, 2, 1, w.group, w.in_features
    return w, w, 0, 1, 1, w.shape[2]


def kernel_mode(mode: int) -> int:
    """The kernels' MODE of an _operand / moe_configs mode: W8A8's 3 runs FP8's 1, with
    A_FP8."""
    return 1 if mode == 3 else mode


def _gemm(a: torch.Tensor, w: torch.Tensor | Experts, out: torch.Tensor, n: int,
          sorted_slots: torch.Tensor, block_expert: torch.Tensor, total: torch.Tensor,
          route: torch.Tensor | None, a_div: int, block_m: int, config: dict | None = None
          ) -> None:
    """config: BLOCK_N, BLOCK_K, num_warps, num_stages (default: the tuned table's,
    ops.triton.moe_configs, else the choices below). INT4 experts at prompt sizes
    (moe_dense.takes) are dequantized a chunk at a time and multiplied as float ones."""
    data, scales, mode, s_bn, s_bk, k = _operand(w)
    parts = [(0, data.shape[0], data)]
    if moe_dense.takes(w, out.shape[0]):
        parts, mode, s_bn, s_bk = moe_dense.chunks(w, a.dtype), 0, 1, 1
    elif isinstance(w, Int4ExpertTiles):  # (INT4 experts repacked for it at load time)
        if not moe_int4_wgmma.takes(w, a, block_m):
            raise ValueError(f"fused_moe: INT4 expert tiles take {w.params.dtype} activations "
                             f"in blocks of {moe_int4_wgmma.ROWS} rows, not {a.dtype} in "
                             f"{block_m}")
        return moe_int4_wgmma.gemm(a, w, out, n, sorted_slots, block_expert, total, route,
                                   a_div, block_m)
    gated = route is None
    config = config or lookup(a.device, "sorted", mode, n, k, out.shape[0], s_bk)
    if config is not None and rows_per_block(out.shape[0], data.shape[0], config) != block_m:
        config = None  # (tuned for blocks of another size than the alignment's)
    if config is not None and mode == 3 and not w8a8_tile("sorted", config["BLOCK_K"],
                                                          config["BLOCK_N"], block_m):
        config = None
    launch = {"num_warps": 4}
    if config is not None:
        block_n, block_k = config["BLOCK_N"], config["BLOCK_K"]
        launch = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    else:
        block_n, block_k = _blocks(mode, s_bk, k, block_m)
    grid = (block_expert.numel() * cdiv(n, block_n),)
    mode_pdl = pdl(a.device)
    launch.update(PDL=mode_pdl, launch_pdl=mode_pdl > 0)
    a_scales, a_fp8 = out, 0
    if mode == 3:  # W8A8: blocks of many rows take the inputs rounded once, fewer round them
        a_fp8 = 1
        if block_m >= 64:
            (a, a_scales), a_fp8 = fp8_groups.quantize(a), 2
    for first, last, part in parts:
        scales = scales if mode else part
        _sorted_gemm[grid](a, part, scales, out, sorted_slots, block_expert, total,
                           route if route is not None else out, a_scales, n, k, out.shape[0],
                           first, last, a.stride(0), *part.stride(), *scales.stride(),
                           out.stride(0), a_scales.stride(0), ONE_BITS, A_DIV=a_div,
                           MODE=kernel_mode(mode), S_BN=s_bn, S_BK=s_bk, A_FP8=a_fp8,
                           GATED=gated, ROUTED=not gated,
                           F32_DOT=_INTERPRET or a.dtype == torch.float32,
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **launch)


def _blocks(mode: int, s_bk: int, k: int, block_m: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of _gemm without a tuned entry."""
    # (decode: narrower output tiles, more blocks for the GPU's SMs)
    block_n = 32 if _INTERPRET or block_m == 16 else 64
    block_k = 32 if _INTERPRET else 64
    if mode == 2:  # INT4: 16 words a step (a dot per nibble), whole groups of scales;
        block_k = 128  # wide N: ~6 instructions a weight at 128, ~7.6 at 32 (moe_sass.py)
        block_n = block_n if _INTERPRET else 128
    elif mode == 3:  # W8A8: a group of 128 inputs a step, outputs on the MMA's 64 side
        block_k, block_n = 128, max(block_n, 64)
    elif mode != 0 and s_bk < k:  # a tile within one scale's inputs
        block_k = min(block_k, s_bk)
        if s_bk % block_k:
            raise ValueError(f"fused_moe: scales over {s_bk} inputs need a multiple of 16")
    return block_n, block_k


def rows_per_block(slots: int, num_experts: int, config: dict | None = None) -> int:
    """BLOCK_M of the sorted path: the gate_up matrix's tuned entry's (config, a moe_configs
    entry: both matrices share the alignment, and down's entry counts only with the same
    BLOCK_M), else 16 while experts average at most 16 slots, else 64."""
    if config is not None and "BLOCK_M" in config:
        return config["BLOCK_M"]
    return 16 if slots <= 16 * num_experts else 64


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor | Experts, down: torch.Tensor | Experts,
              weights: torch.Tensor, ids: torch.Tensor,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """Σ over each token's experts of weight · down(silu(gate) · up) (+ residual), in x's
    dtype: the twin of torch_ref.fused_moe (same arguments; x [T, hidden] contiguous)."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    from frugal.ops.triton.moe_gemv import MAX_SLOTS, fused_moe_gemv, takes  # (builds on this)

    if tokens * top_k <= MAX_SLOTS and takes(gate_up) and takes(down):
        # a few tokens: no sorting, each slot reads its expert
        return fused_moe_gemv(x, gate_up, down, weights, ids, residual)
    if (tokens * top_k <= MAX_SLOTS and moe_int4_wgmma.takes(gate_up, x, moe_int4_wgmma.ROWS[0])
            and isinstance(down, Int4ExpertTiles)):  # (the same, a block of rows per slot)
        return moe_int4_wgmma.fused_moe_slots(x, gate_up, down, weights, ids, residual)
    num_experts, inter = gate_up.shape[0], down.shape[2]
    slots = tokens * top_k
    _, _, mode, _, s_bk, k = _operand(gate_up)
    if moe_dense.takes(gate_up, slots):  # (multiplied as float experts: their tiles)
        mode, s_bk = 0, 1
    config = lookup(x.device, "sorted", mode, inter, k, slots, s_bk)
    block_m = rows_per_block(slots, num_experts, config)
    if mode == 2 and any(isinstance(w, Int4ExpertTiles) for w in (gate_up, down)):
        block_m = min(block_m, moe_int4_wgmma.ROWS[-1])  # (the wgmma kernel's rows)
    sorted_slots, block_expert, total = align(ids, num_experts, block_m)
    act = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    _gemm(x, gate_up, act, inter, sorted_slots, block_expert, total, None, top_k, block_m,
          config)
    out = torch.empty(slots, hidden, dtype=x.dtype, device=x.device)
    _gemm(act, down, out, hidden, sorted_slots, block_expert, total,
          weights.flatten().float(), 1, block_m)
    return combine(out, top_k, residual, x.dtype)
