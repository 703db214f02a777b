"""Rotary position embedding of queries and keys in one launch: torch_ref.rotary's twins.

MLA rotates the rotary part of every head's query and the one rotary key a token (DSA's indexer
its keys' first dims); as PyTorch ops that is ~10 kernels a tensor (gather cos/sin, upcast,
four products, two sums, stack, downcast), ~20 a layer in every decode step's CUDA graph and
~27 dispatches a layer on the host in a prompt step. Here a program takes one token: it reads
its position's cos and sin once and rotates all of the token's query and key heads, in fp32,
into new tensors in the inputs' dtype (the inputs may be strided views: a split of a wider row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from frugal.ops.triton.sizes import next_power_of_2


@triton.jit
def _rotate_heads(x_ptr, o_ptr, sxt, sxh, sot, soh, t, cos, sin, half,
                  HEADS: tl.constexpr, ROT: tl.constexpr, WIDTH: tl.constexpr,
                  PAIRS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_P: tl.constexpr):
    """One token's HEADS heads of x (WIDTH wide, the first ROT = 2 · (ROT // 2) rotating) into o:
    NeoX halves (i, ROT/2 + i) or DeepSeek's adjacent pairs (2i, 2i + 1) by frequency i."""
    heads = tl.arange(0, BLOCK_H)
    h_ok = heads[:, None] < HEADS
    ok = h_ok & half[None, :]
    i = tl.arange(0, BLOCK_R)[None, :]
    if PAIRS:
        first, second = 2 * i, 2 * i + 1
    else:
        first, second = i, i + ROT // 2
    x_row = x_ptr + t * sxt + heads[:, None] * sxh
    o_row = o_ptr + t * sot + heads[:, None] * soh
    a = tl.load(x_row + first, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(x_row + second, mask=ok, other=0.0).to(tl.float32)
    out_ty = o_ptr.dtype.element_ty
    tl.store(o_row + first, (a * cos - b * sin).to(out_ty), mask=ok)
    tl.store(o_row + second, (b * cos + a * sin).to(out_ty), mask=ok)
    if WIDTH > ROT:  # (partial rotary: the other dims pass through)
        rest = ROT + tl.arange(0, BLOCK_P)[None, :]
        keep = h_ok & (rest < WIDTH)
        tl.store(o_row + rest, tl.load(x_row + rest, mask=keep, other=0.0), mask=keep)


@triton.jit
def _rotary(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr, sqt, sqh, skt, skh, sqot, sqoh,
            skot, skoh, scs, QH: tl.constexpr, KH: tl.constexpr, ROT: tl.constexpr,
            WIDTH: tl.constexpr, PAIRS: tl.constexpr, BLOCK_QH: tl.constexpr,
            BLOCK_KH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    r = tl.arange(0, BLOCK_R)
    half = r < ROT // 2
    cos = tl.load(cs_ptr + pos * scs + r, mask=half, other=0.0)[None, :]
    sin = tl.load(cs_ptr + pos * scs + ROT // 2 + r, mask=half, other=0.0)[None, :]
    _rotate_heads(q_ptr, qo_ptr, sqt, sqh, sqot, sqoh, t, cos, sin, half, QH, ROT, WIDTH, PAIRS,
                  BLOCK_QH, BLOCK_R, BLOCK_P)
    _rotate_heads(k_ptr, ko_ptr, skt, skh, skot, skoh, t, cos, sin, half, KH, ROT, WIDTH, PAIRS,
                  BLOCK_KH, BLOCK_R, BLOCK_P)


def _rotary_launch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   cos_sin: torch.Tensor, pairs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, q_heads, width = q.shape
    rot = cos_sin.shape[1]
    if (k.shape[0] != tokens or k.shape[2] != width or rot > width or rot % 2
            or (pairs and rot != width) or q.stride(2) != 1 or k.stride(2) != 1
            or cos_sin.stride(1) != 1 or positions.shape != (tokens,) or positions.stride(0) != 1):
        raise ValueError(f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)} (unit-stride rows "
                         f"of one width), cos_sin {tuple(cos_sin.shape)} (an even rotary "
                         f"width), positions {tuple(positions.shape)} (contiguous)")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    _rotary[(tokens,)](q, k, q_out, k_out, positions, cos_sin, q.stride(0), q.stride(1),
                       k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
                       k_out.stride(0), k_out.stride(1), cos_sin.stride(0), QH=q_heads,
                       KH=k.shape[1], ROT=rot, WIDTH=width, PAIRS=pairs,
                       BLOCK_QH=next_power_of_2(q_heads), BLOCK_KH=next_power_of_2(k.shape[1]),
                       BLOCK_R=max(next_power_of_2(rot // 2), 1),
                       BLOCK_P=max(next_power_of_2(width - rot), 1), num_warps=4)
    return q_out, k_out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_ref.rotary.apply_rotary's twin (NeoX halves, partial rotary): q [T, heads, D],
    k [T, kv_heads, D] (as wide as q; unit stride in D), positions [T] contiguous int32/int64,
    cos_sin [max_positions, rot] fp32 (cos | sin), rot even. Returns new contiguous (q, k) in
    their dtypes."""
    return _rotary_launch(q, k, positions, cos_sin, pairs=False)


def apply_rotary_pairs(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                       cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_ref.rotary.apply_rotary_pairs's twin (adjacent pairs, every dim rotary)."""
    return _rotary_launch(q, k, positions, cos_sin, pairs=True)
