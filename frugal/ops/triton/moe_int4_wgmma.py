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
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from frugal.ops.triton.int4_linear import _OFFSET, TILE_K
from frugal.ops.triton.int4_wgmma import _issue, row_offsets
from frugal.ops.triton.int4_wgmma_tile import tile
from frugal.ops.triton.moe_combine import combine
from frugal.ops.triton.moe_int4_tiles import Int4ExpertTiles
from frugal.ops.triton.split_k import counters, grid, partials

ROWS = (16, 32, 64)  # BLOCK_M the kernel takes (the alignment's rows)


def takes(w, x: torch.Tensor, block_m: int) -> bool:
    """Whether `gemm` runs experts w for blocks of block_m rows of x."""
    return (isinstance(w, Int4ExpertTiles) and block_m in ROWS and x.dtype in _OFFSET
            and x.dtype == w.params.dtype and x.shape[1] == w.in_features and x.stride(1) == 1
            and x.stride(0) == x.shape[1])  # (rows read K apart)


@gluon.jit(do_not_specialize=["num_slots"])  # (num_slots changes from step to step)
def _kernel(x_ptr, w_ptr, p_ptr, out_ptr, sorted_ptr, block_expert_ptr, total_ptr, route_ptr,
            part_ptr, count_ptr, num_slots, N, K_PARTS, som,
            KP: gl.constexpr, GROUP: gl.constexpr, A_DIV: gl.constexpr, GATED: gl.constexpr,
            BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, WARPS: gl.constexpr,
            STAGES: gl.constexpr, UNROLL: gl.constexpr, CENTERED: gl.constexpr,
            OFFSET: gl.constexpr, EVEN_K: gl.constexpr, K_ALIGN: gl.constexpr,
            SPLIT_K: gl.constexpr, PER_SLOT: gl.constexpr):
    """One block of BLOCK_M sorted slots (grid axis 1) times BLOCK_N outputs (axis 0) of its
    expert's [N (2N if GATED), K] matrix, over this program's share of the 128-input tiles
    (axis 2: SPLIT_K > 1, reduced by the last, _finish). x [*, K]: slot s reads row
    s // A_DIV; out [slots, N] (row stride som). Layouts and the K loop as int4_wgmma._kernel's.
    PER_SLOT: block pid_m is slot pid_m alone (its expert block_expert_ptr[pid_m], the routing
    ids; no sorting: sorted_ptr and total_ptr unread)."""
    ASYNC: gl.constexpr = BLOCK_M <= 16 or CENTERED
    GK: gl.constexpr = GROUP if GROUP < 128 else 128
    G: gl.constexpr = 128 // GK
    TILES_PER_GROUP: gl.constexpr = GROUP // 128 if GROUP > 128 else 1
    HALVES: gl.constexpr = 2 if GATED else 1
    S: gl.constexpr = BLOCK_N // 16
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    w_layout: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1, 4], [1, 1, 8, 4, 1],
                                              [WARPS, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [WARPS, 1], [1, 0])
    p_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, WARPS], [1, 0])
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES * HALVES, S, 2, 8, 4, 4],
                                       gl.SwizzledSharedLayout(4, 1, 1, [4, 3, 2, 1, 0]))
    x_smem = gl.allocate_shared_memory(
        x_ptr.dtype.element_ty, [STAGES, 4 * BLOCK_M, 32],
        gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2))
    p_smem = gl.allocate_shared_memory(gl.int32, [STAGES, HALVES * G, BLOCK_N],
                                       gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    K = K_PARTS * K_ALIGN
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    if not PER_SLOT:
        if pid_m * BLOCK_M >= gl.load(total_ptr):
            return
    expert = gl.load(block_expert_ptr + pid_m).to(gl.int64)
    width = 2 * N if GATED else N
    w_ptr += expert * (((width + 63) // 64) * (KP * 8))  # (blocks of 64 rows, KP / 8 words)
    p_ptr += expert * ((KP // GROUP) * width)  # ((scale, min) pairs as int32)
    per = gl.cdiv(KP // 128, SPLIT_K)
    first = gl.program_id(2) * per
    last = gl.minimum(first + per, KP // 128)

    L4: gl.constexpr = gl.SliceLayout(4, w_layout)
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    ws = gl.arange(0, S, gl.SliceLayout(1, L2))
    wh = gl.arange(0, 2, gl.SliceLayout(0, L2))
    wg = gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    wt = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    wq = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(
        3, w_layout)))))
    rows = (pid_n * BLOCK_N + gl.expand_dims(gl.expand_dims(ws * 16, 1) + gl.expand_dims(wh * 8, 0),
                                             2) + gl.expand_dims(gl.expand_dims(wg, 0), 1))
    rows4 = gl.expand_dims(rows, 3)
    wt5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(wt * 4, 0), 1), 2), 4)
    wq5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(wq, 0), 1), 2), 3)
    cols = wt5 + wq5
    w_ptrs = w_ptr + gl.expand_dims(row_offsets(rows4, KP), 4) + cols
    w_up = w_ptrs
    if GATED:
        w_up = w_ptr + gl.expand_dims(row_offsets(rows4 + N, KP), 4) + cols
    w_mask = gl.expand_dims(rows4 < N, 4)
    # the block's rows: slot s (sorted) reads x's row s // A_DIV; padding slots read nothing
    xr = gl.arange(0, 4 * BLOCK_M, gl.SliceLayout(1, x_layout))  # chunk · BM + row
    x_slot = _slots(sorted_ptr, pid_m, xr % BLOCK_M, num_slots, BLOCK_M, PER_SLOT)
    x_cols = gl.expand_dims((xr // BLOCK_M) * 32, 1) + gl.expand_dims(
        gl.arange(0, 32, gl.SliceLayout(0, x_layout)), 0)
    x_ptrs = x_ptr + gl.expand_dims((x_slot // A_DIV).to(gl.int64) * K, 1) + x_cols
    x_mask = gl.expand_dims(x_slot < num_slots, 1)
    pr = gl.arange(0, HALVES * G, gl.SliceLayout(1, p_layout))
    pn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, p_layout))
    p_offs = gl.expand_dims((pr // G) * N + (pr % G) * width, 1) + gl.expand_dims(pn, 0)
    p_mask = gl.expand_dims(pn < N, 0)

    ones = gl.full([BLOCK_N, 32], 1.0, x_ptr.dtype.element_ty, layout=a_layout)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=acc_layout)
    acc_up = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=acc_layout)
    for i in gl.static_range(STAGES - 1):
        _issue(first + i, last, w_ptrs, w_up, w_mask, x_ptrs, x_mask, x_cols, K, p_ptr + p_offs,
               p_mask, w_smem, x_smem, p_smem.index(i), i, G * width, GATED, EVEN_K,
               TILES_PER_GROUP)
    for t0 in range(first, last, UNROLL):
        for u in gl.static_range(UNROLL):
            t = t0 + u
            if t < last:
                async_copy.wait_group(STAGES - 2)
                gl.thread_barrier()
                fence_async_shared()
                if UNROLL == STAGES:
                    stage = u
                    refill = (u + STAGES - 1) % STAGES
                else:
                    stage = (t - first) % STAGES
                    refill = (t - first + STAGES - 1) % STAGES
                _issue(t + STAGES - 1, last, w_ptrs, w_up, w_mask, x_ptrs, x_mask, x_cols, K,
                       p_ptr + p_offs, p_mask, w_smem, x_smem, p_smem.index(refill), refill,
                       G * width, GATED, EVEN_K, TILES_PER_GROUP)
                words = w_smem.index(stage * HALVES).load(w_layout)
                words_up = w_smem.index(stage * HALVES + 1).load(w_layout) if GATED else words
                acc, acc_up = tile(words, words_up, x_smem, stage, p_smem.index(stage), ones,
                                    acc, acc_up, GATED, G, OFFSET, a_layout, acc_layout, ASYNC,
                                    CENTERED)
    async_copy.wait_group(0)
    acc = gl.permute(acc, (1, 0))  # [BM, BN]
    acc_up = gl.permute(acc_up, (1, 0))
    out_layout: gl.constexpr = acc.type.layout
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, out_layout))
    slot = _slots(sorted_ptr, pid_m, gl.arange(0, BLOCK_M, gl.SliceLayout(1, out_layout)),
                  num_slots, BLOCK_M, PER_SLOT)
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
    width] by slot and let the last program of the block (a ticket from count_ptr, as
    split_k.finish) add them up in split order and _store them (plain tl)."""
    if SPLIT_K == 1:
        _store(acc, acc_up, slot, offs_n, num_slots, N, som, route_ptr, out_ptr, GATED)
    else:
        width = 2 * N if GATED else N
        mask = (slot < num_slots)[:, None] & (offs_n < N)[None, :]
        rows = slot.to(tl.int64)[:, None] * width + offs_n[None, :]
        stride = num_slots.to(tl.int64) * width
        tl.store(part_ptr + tl.program_id(2) * stride + rows, acc, mask=mask)
        if GATED:
            tl.store(part_ptr + tl.program_id(2) * stride + rows + N, acc_up, mask=mask)
        tl.debug_barrier()  # every thread's partials stored before the ticket is taken
        block = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        ticket = tl.atomic_add(count_ptr + block, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:  # (.cg: from L2, never a stale L1 line)
            acc = tl.load(part_ptr + rows, mask=mask, other=0.0, cache_modifier=".cg")
            if GATED:
                acc_up = tl.load(part_ptr + rows + N, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                acc += tl.load(part_ptr + s * stride + rows, mask=mask, other=0.0,
                               cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(part_ptr + s * stride + rows + N, mask=mask, other=0.0,
                                      cache_modifier=".cg")
            tl.store(count_ptr + block, 0)
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
         config: tuple[int, int, int] = (64, 4, 4)) -> None:
    """moe._gemm's launch for experts in the tile layout: x [*, K] bf16 or fp16 (K even),
    out [slots, n]; route None: gate_up (w has 2n rows), else down. sorted_slots None: a
    block per slot, block_expert the slots' experts (the routing ids, flat). config: BLOCK_N,
    num_warps, STAGES."""
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
    _kernel[launch](x, w.words, w.params.view(torch.int32), out,
                    block_expert if per_slot else sorted_slots, block_expert,
                    block_expert if per_slot else total, route if route is not None else out,
                    partials(split, slots, 2 * n if gated else n, x.device), counters(x.device),
                    slots, n, k // align, out.stride(0), KP=w.padded_k, GROUP=w.group,
                    A_DIV=a_div, GATED=gated, BLOCK_N=block_n, BLOCK_M=block_m, WARPS=warps,
                    STAGES=stages, UNROLL=unroll, CENTERED=w.centered,
                    OFFSET=_OFFSET[x.dtype], EVEN_K=k % TILE_K == 0, K_ALIGN=align,
                    SPLIT_K=split, PER_SLOT=per_slot, num_warps=warps)


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
    out = torch.empty(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    gemm(act, down, out, hidden, None, flat, None, weights.reshape(-1).float().contiguous(), 1,
         ROWS[0])
    return combine(out, top_k, residual, x.dtype)


def split_for(programs: int, tiles: int, target: int = 512, least: int = 4) -> int:
    """Splits of the inputs' tiles for a launch of `programs` busy programs (output blocks x
    the blocks of rows that can hold slots): doubled while the programs stay within `target`
    (the dense kernel's at up to 8 rows) and each split keeps `least` tiles or more."""
    split = 1
    while programs * split * 2 <= target and tiles >= 2 * least * split:
        split *= 2
    return split
