"""The end of a quantized matmul kernel: epilogue, and split-K reduced inside the kernel.

With SPLIT_K programs sharing one block of outputs, each stores its fp32 partial sums, then
takes a ticket from that block's counter; the last to arrive adds the partials up in split
order (deterministic), runs the epilogue, and resets the counter for the next launch. No
extra kernels per matmul (they cost more than the split saves at decode: measured ~25 µs
against ~12 for a Llama-3.1-8B MLP matmul at one token), CUDA-graph safe (the counters
live in one persistent buffer per device, allocated before any capture).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCKS = 1 << 14  # output blocks a split-K launch may have (counters per device)
_counters: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor:
    """The device's zeroed ticket counters [MAX_BLOCKS] int32 (every kernel leaves them 0)."""
    if device not in _counters:
        _counters[device] = torch.zeros(MAX_BLOCKS, dtype=torch.int32, device=device)
    return _counters[device]


def grid(n_blocks: int, m_blocks: int, split: int) -> tuple[tuple[int, int, int], int]:
    """The launch grid (output blocks along N, along M, splits) and the split it uses: no
    split when the blocks would outnumber the counters."""
    if n_blocks * m_blocks > MAX_BLOCKS:
        split = 1
    return (n_blocks, m_blocks, split), split


def partials(split: int, m: int, width: int, device: torch.device) -> torch.Tensor:
    """Scratch for split-K partial sums [split, m, width] fp32 (any content)."""
    return torch.empty(split if split > 1 else 0, m, width, dtype=torch.float32, device=device)


@triton.jit
def tile_range(tiles, SPLIT_K: tl.constexpr):
    """This program's share [first, last) of the inputs' tiles (split over grid axis 2)."""
    per = tl.cdiv(tiles, SPLIT_K)
    first = tl.program_id(2) * per
    return first, tl.minimum(first + per, tiles)


@triton.jit
def load_tile(ptrs, mask, k_mask, EVEN_K: tl.constexpr):
    """tl.load of one tile of 128 inputs, 0 where masked: mask (rows or outputs) and, unless
    EVEN_K (every tile whole), k_mask (the inputs before K), broadcast together."""
    if not EVEN_K:
        mask = mask & k_mask
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def finish(acc, acc_up, offs_m, offs_n, m_mask, n_mask, M, N, part_ptr, count_ptr, b_ptr, r_ptr,
           out_ptr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
           SPLIT_K: tl.constexpr):
    """acc (acc_up if GATED): this program's fp32 sums [BLOCK_M, BLOCK_N] for outputs
    (offs_m, offs_n) of an [M, N] result; the epilogue, by the last program of the block where
    SPLIT_K > 1 (`reduce`). Plain tl operations whose layouts follow acc's, so Gluon kernels
    call it too."""
    if SPLIT_K == 1:
        epilogue(acc, acc_up, offs_m, offs_n, m_mask, n_mask, N, b_ptr, r_ptr, out_ptr, GATED,
                  HAS_BIAS, HAS_RESIDUAL)
    else:
        width = 2 * N if GATED else N
        acc, acc_up, last = reduce(acc, acc_up, offs_m[:, None] * width + offs_n[None, :],
                                   m_mask[:, None] & n_mask[None, :], M * width, N, part_ptr,
                                   count_ptr, GATED, SPLIT_K)
        if last:
            epilogue(acc, acc_up, offs_m, offs_n, m_mask, n_mask, N, b_ptr, r_ptr, out_ptr,
                      GATED, HAS_BIAS, HAS_RESIDUAL)


@triton.jit
def reduce(acc, acc_up, rows, mask, stride, N, part_ptr, count_ptr, GATED: tl.constexpr,
           SPLIT_K: tl.constexpr):
    """Split-K's sums of one output block (SPLIT_K > 1): this program's partials stored at
    part_ptr + split · stride + rows (acc_up N further: the up half), then a ticket from the
    block's counter (count_ptr, one per (program_id(0), program_id(1))); the last program to
    arrive adds them all up in split order and resets the counter. Returns (acc, acc_up,
    last): the block's sums where `last`, whether this program is that one."""
    tl.store(part_ptr + tl.program_id(2) * stride + rows, acc, mask=mask)
    if GATED:
        tl.store(part_ptr + tl.program_id(2) * stride + rows + N, acc_up, mask=mask)
    tl.debug_barrier()  # every thread's partials stored before the ticket is taken
    block = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    ticket = tl.atomic_add(count_ptr + block, 1, sem="acq_rel", scope="gpu")
    last = ticket == SPLIT_K - 1
    if last:  # (.cg: from L2, never a stale L1 line)
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
    return acc, acc_up, last


@triton.jit
def epilogue(acc, acc_up, offs_m, offs_n, m_mask, n_mask, N, b_ptr, r_ptr, out_ptr,
              GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """out[m, n] = silu(gate) · up if GATED (each with its bias), plus the residual."""
    y = acc
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        up = acc_up
        if HAS_BIAS:
            up += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y = y / (1.0 + tl.exp(-y)) * up
    out_offs = offs_m[:, None] * N + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RESIDUAL:
        y += tl.load(r_ptr + out_offs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=out_mask)
