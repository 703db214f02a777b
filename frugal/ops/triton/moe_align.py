"""The slots of a step laid out expert by expert for the sorted MoE GEMMs (vLLM's
moe_align_block_size does it in one CUDA kernel; torch ops took ~20 launches a layer). Up to
BLOCK slots (a decode step: 128 tokens of top-8) one program does it all, `_align`; more slots
take three launches after zeroing the counts:

  _count   slot chunks in parallel: each chunk's histogram of experts, added atomically;
  _layout  one program: every expert's run padded to a multiple of BLOCK_M, their starts (the
           places' cursors), the padded total, each block's expert, the padding sentinel;
  _place   slot chunks in parallel: each slot takes the next place of its expert's run by an
           atomic add on that expert's cursor.

Within an expert's run the slots come in no particular order: each row of the GEMM is computed
alone and stored at its slot, so the order changes no result. Every shape depends only on the
number of slots, so a CUDA graph captures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from frugal.ops.triton.launch import enter, pdl
from frugal.ops.triton.sizes import cdiv, next_power_of_2

BLOCK = 1024  # slots a program of _count and _place takes
CHUNK_BLOCKS = 64  # GEMM row blocks _layout assigns a step


@triton.jit(do_not_specialize=["slots"])  # (the step's slots: any value, one variant)
def _count(ids_ptr, work_ptr, slots, E_PAD: tl.constexpr, BLOCK: tl.constexpr,
           PDL: tl.constexpr):
    enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < slots
    expert = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    counts = tl.histogram(expert, E_PAD, mask=ok)
    tl.atomic_add(work_ptr + tl.arange(0, E_PAD), counts, mask=counts > 0)


@triton.jit(do_not_specialize=["slots", "capacity"])  # (the step's slots: any value, one variant)
def _align(ids_ptr, work_ptr, sorted_ptr, block_expert_ptr, total_ptr, num_experts, slots,
           capacity, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr,
           CHUNK_BLOCKS: tl.constexpr, PDL: tl.constexpr):
    """All three steps by one program for slots ≤ BLOCK: the counts in registers (work_ptr's
    counts are neither read nor written: no zeroing), a barrier between the layout's stores
    (cursors, sentinel) and the places taken from the cursors and stored over the sentinel."""
    enter(PDL)
    offs = tl.arange(0, BLOCK)
    ok = offs < slots
    expert = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    counts = tl.histogram(expert, E_PAD, mask=ok)
    _lay(counts, work_ptr, sorted_ptr, block_expert_ptr, total_ptr, num_experts, slots,
         capacity, BLOCK_M, E_PAD, BLOCK, CHUNK_BLOCKS)
    tl.debug_barrier()
    place = tl.atomic_add(work_ptr + E_PAD + expert, 1, mask=ok)
    tl.store(sorted_ptr + place, offs, mask=ok)


@triton.jit(do_not_specialize=["slots", "capacity"])  # (the step's slots: any value, one variant)
def _layout(work_ptr, sorted_ptr, block_expert_ptr, total_ptr, num_experts, slots, capacity,
            BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr,
            CHUNK_BLOCKS: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    e = tl.arange(0, E_PAD)
    counts = tl.load(work_ptr + e, mask=e < num_experts, other=0)
    _lay(counts, work_ptr, sorted_ptr, block_expert_ptr, total_ptr, num_experts, slots,
         capacity, BLOCK_M, E_PAD, BLOCK, CHUNK_BLOCKS)


@triton.jit
def _lay(counts, work_ptr, sorted_ptr, block_expert_ptr, total_ptr, num_experts, slots,
         capacity, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr,
         CHUNK_BLOCKS: tl.constexpr):
    """The layout from each expert's count [E_PAD] (0 past num_experts), as the module says."""
    e = tl.arange(0, E_PAD)
    real = e < num_experts
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(work_ptr + E_PAD + e, ends - padded, mask=real)  # each run's first place
    tl.store(total_ptr, tl.sum(padded, axis=0))
    for i0 in range(0, capacity, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        tl.store(sorted_ptr + i, tl.full((BLOCK,), 0, tl.int32) + slots, mask=i < capacity)
    ends = tl.where(real, ends, 2147483647)
    num_blocks = capacity // BLOCK_M
    for b0 in range(0, num_blocks, CHUNK_BLOCKS):
        b = b0 + tl.arange(0, CHUNK_BLOCKS)
        # the expert whose run holds the block's first row: how many runs end at or before it
        expert = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.minimum(expert, num_experts - 1), mask=b < num_blocks)


@triton.jit(do_not_specialize=["slots"])  # (the step's slots: any value, one variant)
def _place(ids_ptr, work_ptr, sorted_ptr, slots, E_PAD: tl.constexpr, BLOCK: tl.constexpr,
           PDL: tl.constexpr):
    enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < slots
    expert = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    place = tl.atomic_add(work_ptr + E_PAD + expert, 1, mask=ok)
    tl.store(sorted_ptr + place, offs, mask=ok)


def align(ids: torch.Tensor, num_experts: int, block_m: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids: [T, top_k] expert of each slot -> (sorted [P] int32: slots expert by expert, each
    expert's run padded with S = T · top_k to a multiple of block_m; block_expert [P / block_m]
    int32: the expert of each block (runs past the end: the last expert); total [1] int32: the
    padded length in use). P = S + min(E, S) · (block_m - 1), rounded up to block_m."""
    flat = ids.reshape(-1).contiguous()
    slots = flat.numel()
    e_pad = max(16, next_power_of_2(num_experts))
    capacity = cdiv(slots + min(num_experts, slots) * (block_m - 1), block_m) * block_m
    sorted_slots = torch.empty(capacity, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=ids.device)
    total = torch.empty(1, dtype=torch.int32, device=ids.device)
    mode = pdl(ids.device)
    if slots <= BLOCK:
        work = torch.empty(2 * e_pad, dtype=torch.int32, device=ids.device)  # -, cursors
        _align[(1,)](flat, work, sorted_slots, block_expert, total, num_experts, slots,
                     capacity, BLOCK_M=block_m, E_PAD=e_pad, BLOCK=BLOCK,
                     CHUNK_BLOCKS=CHUNK_BLOCKS, PDL=mode, launch_pdl=mode > 0)
        return sorted_slots, block_expert, total
    work = torch.zeros(2 * e_pad, dtype=torch.int32, device=ids.device)  # counts, cursors
    grid = (cdiv(slots, BLOCK),)
    _count[grid](flat, work, slots, E_PAD=e_pad, BLOCK=BLOCK, PDL=mode, launch_pdl=mode > 0)
    _layout[(1,)](work, sorted_slots, block_expert, total, num_experts, slots, capacity,
                  BLOCK_M=block_m, E_PAD=e_pad, BLOCK=BLOCK, CHUNK_BLOCKS=CHUNK_BLOCKS,
                  PDL=mode, launch_pdl=mode > 0)
    _place[grid](flat, work, sorted_slots, slots, E_PAD=e_pad, BLOCK=BLOCK, PDL=mode,
                 launch_pdl=mode > 0)
    return sorted_slots, block_expert, total
