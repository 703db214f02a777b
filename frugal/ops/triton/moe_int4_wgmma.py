"""INT4 experts on Hopper's warpgroup MMA: int4_wgmma's kernel over the sorted path's blocks.

Each program takes one block of BLOCK_M slots routed to one expert (moe_align's blocks) and
BLOCK_N of that expert's outputs, and computes outᵀ = W_e · xᵀ as int4_wgmma does for a dense
matrix: the expert's words dequantized in registers as the wgmma A operand (int4_wgmma_tile),
the block's activation rows gathered into shared memory as its B operand (N = BLOCK_M, 16 to
64), tiles of 128 inputs streamed through a STAGES-deep cp.async ring. One read of an expert's
weights serves all its rows, and no layout passes through shared memory on the way to the
tensor cores (the Triton kernel's dequantized tiles do, with a barrier each).

Weights: moe_int4_tiles.Int4ExpertTiles (every expert in int4_linear's layout, repacked at
load time). The small-batch GEMV does not read them: up to its slots (moe_gemv.MAX_SLOTS)
fused_moe takes fused_moe_slots here, a block per slot and no sorting (PER_SLOT), past them the
sorted path's blocks of 16 to 64 rows, and at prompt sizes it dequantizes them (moe_dense).
Outputs as moe._sorted_gemm's: gate_up (GATED, rows 0..N-1 the gate, N..2N-1 the up half)
writes silu(gate) · up of each slot; down (ROUTED) each slot's product times its routing weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from frugal.ops.triton.int4_linear import _OFFSET, TILE_K, kernel_params
from frugal.ops.triton.int4_wgmma import inputs, products
from frugal.ops.triton.launch import enter, pdl
from frugal.ops.triton.moe_combine import sum_token, summed, token_sums
from frugal.ops.triton.moe_int4_tiles import Int4ExpertTiles
from frugal.ops.triton.split_k import counters, grid, partials, reduce

ROWS = (16, 32, 64)  # BLOCK_M the kernel takes (the alignment's rows)


def takes(w, x: torch.Tensor, block_m: int) -> bool:
    """Whether `gemm` runs experts w for blocks of block_m rows of x."""
    return (isinstance(w, Int4ExpertTiles) and block_m in ROWS and x.dtype in _OFFSET
            and x.dtype == w.params.dtype and x.shape[1] == w.in_features and x.stride(1) == 1
            and x.stride(0) == x.shape[1])  # (rows read K apart)


@gluon.jit(do_not_specialize=["num_slots"])  # (num_slots changes from step to step)
def _moe_int4_wgmma(x_ptr, w_ptr, p_ptr, out_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                    route_ptr, part_ptr, count_ptr, res_ptr, dst_ptr, num_slots, N, K_PARTS, som,
                    KP: gl.constexpr, GROUP: gl.constexpr, A_DIV: gl.constexpr, GATED: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, WARPS: gl.constexpr,
                    STAGES: gl.constexpr, UNROLL: gl.constexpr, CENTERED: gl.constexpr,
                    OFFSET: gl.constexpr, EVEN_K: gl.constexpr, K_ALIGN: gl.constexpr,
                    SPLIT_K: gl.constexpr, PER_SLOT: gl.constexpr, TOP_K: gl.constexpr,
                    RESIDUAL: gl.constexpr, PDL: gl.constexpr):
    """One block of BLOCK_M sorted slots (grid axis 1) times BLOCK_N outputs (axis 0) of its
    expert's [N (2N if GATED), K] matrix, over this program's share of the 128-input tiles
    (axis 2: SPLIT_K > 1, reduced by the last, _finish). x [*, K]: slot s reads row
    s // A_DIV; out [slots, N] (row stride som). The K loop: int4_wgmma.products.
    PER_SLOT: block pid_m is slot pid_m alone (its expert block_expert_ptr[pid_m], the routing
    ids; no sorting: sorted_ptr and total_ptr unread); TOP_K > 0 (with PER_SLOT, down, no
    split): and each token's TOP_K slots summed into dst_ptr (moe_combine.sum_token)."""
    K = K_PARTS * K_ALIGN
    enter(PDL)
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    if not PER_SLOT:
        if pid_m * BLOCK_M >= gl.load(total_ptr):
            return
    expert = gl.load(block_expert_ptr + pid_m).to(gl.int64)
    width = 2 * N if GATED else N
    w_ptr += expert * (((width + 63) // 64) * (KP * 8))  # (blocks of 64 rows, KP / 8 words)
    p_ptr += expert * ((KP // GROUP) * width)  # ((scale, min) pairs as int32, or scales)
    # the block's rows: slot s (sorted) reads x's row s // A_DIV; padding slots read nothing
    xr, x_cols = inputs(BLOCK_M, WARPS)
    x_slot = _slots(sorted_ptr, pid_m, xr % BLOCK_M, num_slots, BLOCK_M, PER_SLOT)
    x_ptrs = x_ptr + gl.expand_dims((x_slot // A_DIV).to(gl.int64) * K, 1) + x_cols
    x_mask = gl.expand_dims(x_slot < num_slots, 1)
    acc, acc_up = products(x_ptrs, x_mask, x_cols, K, w_ptr, p_ptr, pid_n, N, KP, GROUP, GATED,
                           BLOCK_N, BLOCK_M, WARPS, STAGES, UNROLL, CENTERED, OFFSET, EVEN_K,
                           SPLIT_K)
    out_layout: gl.constexpr = acc.type.layout
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, out_layout))
    slot = _slots(sorted_ptr, pid_m, gl.arange(0, BLOCK_M, gl.SliceLayout(1, out_layout)),
                  num_slots, BLOCK_M, PER_SLOT)
    if TOP_K:  # (a block a slot: its row 0, the others padding)
        y = gl.sum(gl.where(gl.expand_dims(slot < num_slots, 1), acc, 0.0), axis=0)
        sum_token(y * gl.load(route_ptr + pid_m), pid_m, offs_n, offs_n < N, N, pid_n,
                  gl.num_programs(0), out_ptr, res_ptr, dst_ptr, count_ptr, TOP_K, RESIDUAL)
    else:
        _finish(acc, acc_up, slot, offs_n, num_slots, N, som, part_ptr, count_ptr, route_ptr,
                out_ptr, GATED, SPLIT_K)


@triton.jit
def _slots(sorted_ptr, pid_m, row, num_slots, BLOCK_M: tl.constexpr, PER_SLOT: tl.constexpr):
    """The slots of rows `row` of block pid_m (num_slots: a padding row) (plain tl)."""
    if PER_SLOT:
        slot = tl.where(row == 0, pid_m, num_slots)
    else:
        slot = tl.load(sorted_ptr + pid_m * BLOCK_M + row)
    return slot


@triton.jit
def _finish(acc, acc_up, slot, offs_n, num_slots, N, som, part_ptr, count_ptr, route_ptr,
            out_ptr, GATED: tl.constexpr, SPLIT_K: tl.constexpr):
    """_store this program's sums, or (SPLIT_K > 1) keep them in part_ptr [SPLIT_K, slots,
    width] by slot and let the last program of the block _store the total (split_k.reduce)
    (plain tl)."""
    if SPLIT_K == 1:
        _store(acc, acc_up, slot, offs_n, num_slots, N, som, route_ptr, out_ptr, GATED)
    else:
        width = 2 * N if GATED else N
        acc, acc_up, last = reduce(
            acc, acc_up, slot.to(tl.int64)[:, None] * width + offs_n[None, :],
            (slot < num_slots)[:, None] & (offs_n < N)[None, :], num_slots.to(tl.int64) * width,
            N, part_ptr, count_ptr, GATED, SPLIT_K)
        if last:
            _store(acc, acc_up, slot, offs_n, num_slots, N, som, route_ptr, out_ptr, GATED)


@triton.jit
def _store(acc, acc_up, slot, offs_n, num_slots, N, som, route_ptr, out_ptr,
           GATED: tl.constexpr):
    """out[slot, n] = silu(gate) · up if GATED, else the product times the slot's routing
    weight (plain tl: the layouts follow acc's)."""
    row_ok = slot < num_slots
    if GATED:
        y = acc / (1.0 + tl.exp(-acc)) * acc_up
    else:
        y = acc * tl.load(route_ptr + slot, mask=row_ok, other=0.0)[:, None]
    tl.store(out_ptr + slot.to(tl.int64)[:, None] * som + offs_n[None, :],
             y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n < N)[None, :])


def gemm(x: torch.Tensor, w: Int4ExpertTiles, out: torch.Tensor, n: int,
         sorted_slots: torch.Tensor | None, block_expert: torch.Tensor,
         total: torch.Tensor | None, route: torch.Tensor | None, a_div: int, block_m: int,
         config: tuple[int, int, int] = (64, 4, 4), sums: tuple | None = None) -> bool:
    """moe._gemm's launch for experts in the tile layout: x [*, K] bf16 or fp16 (K even),
    out [slots, n]; route None: gate_up (w has 2n rows), else down. sorted_slots None: a
    block per slot, block_expert the slots' experts (the routing ids, flat). config: BLOCK_N,
    num_warps, STAGES. sums (down a block a slot, out fp32): (dst [tokens, n], residual or
    None, top_k), each token's slots summed into dst by the launch where it can (no split,
    moe_combine.token_sums); returns whether it did."""
    block_n, warps, stages = config
    k = x.shape[1]
    if block_m not in ROWS or x.dtype not in _OFFSET or k != w.in_features or k % 2:
        raise ValueError(f"moe_int4_wgmma: blocks of {block_m} rows, {x.dtype} activations "
                         f"with {k} inputs (weights {w.in_features}) are not taken")
    align = 8 if k % 8 == 0 else 2
    gated = route is None
    per_slot = sorted_slots is None
    slots = out.shape[0]
    n_blocks = triton.cdiv(n, block_n)
    split = split_for(n_blocks * min(slots, w.shape[0]), w.padded_k // TILE_K)
    launch, split = grid(n_blocks, slots if per_slot else block_expert.numel(), split)
    # (the ring's stages as constants, as int4_linear's: not for a split's few tiles, where
    # gate_up a slot a block would spill registers)
    unroll = stages if split == 1 and (block_m <= 16 if gated else block_m <= 32) else 1
    dst, residual, top_k = token_sums(sums if split == 1 and per_slot else None, out, n,
                                      n_blocks, not gated)
    launch_pdl = pdl(x.device)
    _moe_int4_wgmma[launch](x, w.words, kernel_params(w), out,
                    block_expert if per_slot else sorted_slots, block_expert,
                    block_expert if per_slot else total, route if route is not None else out,
                    partials(split, slots, 2 * n if gated else n, x.device), counters(x.device),
                    residual if residual is not None else out, dst, slots, n, k // align,
                    out.stride(0), KP=w.padded_k, GROUP=w.group, A_DIV=a_div, GATED=gated,
                    BLOCK_N=block_n, BLOCK_M=block_m, WARPS=warps, STAGES=stages, UNROLL=unroll,
                    CENTERED=w.centered, OFFSET=_OFFSET[x.dtype], EVEN_K=k % TILE_K == 0,
                    K_ALIGN=align, SPLIT_K=split, PER_SLOT=per_slot, TOP_K=top_k,
                    RESIDUAL=residual is not None, PDL=launch_pdl, num_warps=warps,
                    launch_pdl=launch_pdl > 0)
    return top_k > 0


def fused_moe_slots(x: torch.Tensor, gate_up: Int4ExpertTiles, down: Int4ExpertTiles,
                    weights: torch.Tensor, ids: torch.Tensor,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """ops.triton.moe.fused_moe for a few tokens (moe_gemv.MAX_SLOTS slots at most): a block of
    16 rows per slot, no sorting (its kernels cost more than the products there), each slot
    reading its expert (as the GEMV does)."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    inter = down.shape[2]
    flat = ids.reshape(-1).contiguous()
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    gemm(x, gate_up, act, inter, None, flat, None, None, top_k, ROWS[0])
    # (each slot's product kept in fp32 until the top_k are summed, as the GEMV does)
    route = weights.reshape(-1).float().contiguous()
    return summed(lambda out, sums: gemm(act, down, out, hidden, None, flat, None, route, 1,
                                         ROWS[0], sums=sums), x, top_k, residual)


def split_for(programs: int, tiles: int, target: int = 512, least: int = 4) -> int:
    """Splits of the inputs' tiles for a launch of `programs` busy programs (output blocks x
    the blocks of rows that can hold slots): doubled while the programs stay within `target`
    (the dense kernel's at up to 8 rows) and each split keeps `least` tiles or more."""
    split = 1
    while programs * split * 2 <= target and tiles >= 2 * least * split:
        split *= 2
    return split
