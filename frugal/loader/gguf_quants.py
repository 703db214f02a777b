"""Vectorized dequantization of GGML block formats to float32 tensors.

Each format stores a row as blocks of 32 weights: an fp16 scale `d` (and for Q4_1 an fp16 min `m`)
followed by the packed integers. Within a 4-bit block, byte j holds weight j in its low nibble and
weight j + 16 in its high nibble.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from frugal.quant.int4 import Int4Weight, pack

BLOCK = 32
# bytes per block of 32 weights
BLOCK_BYTES = {T.Q8_0: 34, T.Q4_0: 18, T.Q4_1: 20}


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Bytes [start, start+2) of each block read as one fp16 -> [num_blocks, 1] fp32."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """[num_blocks, 16] uint8 -> [num_blocks, 32] uint8 codes in weight order (low nibbles
    first, then high)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """_codes as fp32."""
    return _codes(packed).float()


def dequantize(raw: np.ndarray, ggml_type: T, shape: tuple[int, ...]) -> torch.Tensor:
    """raw: the tensor's bytes as the gguf reader gives them; shape: the torch (row-major) shape.

    Returns a float32 tensor of `shape`; values equal llama.cpp's (and gguf-py's) dequantization.
    """
    if ggml_type in (T.F32, T.F16, T.BF16):
        if ggml_type == T.BF16:
            data = torch.from_numpy(np.array(raw, copy=True).view(np.int16)).view(torch.bfloat16)
        else:
            data = torch.from_numpy(np.array(raw, copy=True))
        return data.float().reshape(shape)
    if ggml_type not in BLOCK_BYTES:
        raise ValueError(f"GGUF tensor type {ggml_type.name} is not supported "
                         f"(supported: F32, F16, BF16, {', '.join(t.name for t in BLOCK_BYTES)})")
    blocks = torch.from_numpy(np.array(raw, copy=True)).view(torch.uint8)
    blocks = blocks.reshape(-1, BLOCK_BYTES[ggml_type])
    if ggml_type == T.Q8_0:
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        out = _half(blocks, 0) * q
    elif ggml_type == T.Q4_0:
        out = _half(blocks, 0) * (_nibbles(blocks[:, 2:]) - 8.0)
    else:  # Q4_1
        out = _half(blocks, 0) * _nibbles(blocks[:, 4:]) + _half(blocks, 2)
    return out.reshape(shape)


def to_int4(raw: np.ndarray, ggml_type: T, shape: tuple[int, int]) -> Int4Weight:
    """A Q4_0 / Q4_1 matrix as INT4 without re-quantizing: each block of 32 is one group
    (Q4_0: zero 8; Q4_1: its min), codes in order. Dequantizes bit-identically to dequantize."""
    if ggml_type not in (T.Q4_0, T.Q4_1):
        raise ValueError(f"GGUF tensor type {ggml_type.name} is not 4-bit (Q4_0, Q4_1)")
    blocks = torch.from_numpy(np.array(raw, copy=True)).view(torch.uint8)
    blocks = blocks.reshape(-1, BLOCK_BYTES[ggml_type])
    n, k = shape
    first = 2 if ggml_type == T.Q4_0 else 4
    codes = _codes(blocks[:, first:])
    scales = _half(blocks, 0).view(n, k // BLOCK)
    packed = pack(codes.reshape(n, k))
    if ggml_type == T.Q4_0:
        return Int4Weight(packed, scales, zeros=torch.full_like(scales, 8.0))
    return Int4Weight(packed, scales, mins=_half(blocks, 2).view(n, k // BLOCK))
