"""Quantized routed experts: every expert's INT4 or FP8 matrix stacked in one tensor each.

An MoE layer's routed experts share one shape, so their quantized weights stack on a leading
expert dim [E, ...] (the fused MoE kernels index it by expert):
  Fp8Experts:  data [E, N, K] float8_e4m3fn, scales [E, ceil(N / block), ceil(K / block)] fp32
               (128×128 blocks: DeepSeek / Kimi / GLM FP8) or [E, N, 1] (per output channel);
               w8a8: the activations rounded to FP8 too, one scale per token (row) and 128
               inputs (quant.fp8.quantize_groups, as DeepSeek's FP8 inference does), and
               multiplied on FP8 tensor cores where the kernels can;
  Int4Experts: packed [E, N, K / 8] int32 (compressed-tensors pack-quantized, as Int4Weight),
               scales [E, N, K / group], symmetric codes (w = (u - 8) · scale: Kimi K2's
               routed experts, group 32).
`expert(e)` is expert e's matrix as the dense forms (quant.fp8.Fp8Weight, quant.int4.Int4Weight),
so both dequantize with their source format's arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from frugal.quant.fp8 import Fp8Weight, quantize_fp8
from frugal.quant.int4 import Int4Weight, quantize_rtn

EXPERT_BLOCK = 128  # FP8 block of experts quantized here (as DeepSeek/Kimi/GLM ship them)
EXPERT_GROUP = 32  # INT4 group of experts quantized here (as Kimi K2 ships them)


@dataclass
class Fp8Experts:
    data: torch.Tensor
    scales: torch.Tensor
    block: int | None
    w8a8: bool = False

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.data.shape)

    def __post_init__(self) -> None:
        if self.w8a8 and self.block is not None and self.block % 128:
            raise ValueError(f"W8A8 FP8 experts: weight blocks of a multiple of 128 or per "
                             f"channel (their inputs round per 128), not {self.block}")

    def expert(self, e: int) -> Fp8Weight:
        """Expert e's weight (its activations' rounding is the experts' own: w8a8 above)."""
        return Fp8Weight(self.data[e], self.scales[e], self.block)

    def to(self, device: torch.device | str) -> Fp8Experts:
        return Fp8Experts(self.data.to(device), self.scales.to(device), self.block, self.w8a8)


@dataclass
class Int4Experts:
    packed: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, words = self.packed.shape
        return e, n, words * 8

    @property
    def group_size(self) -> int:
        return self.shape[2] // self.scales.shape[2]

    def expert(self, e: int) -> Int4Weight:
        return Int4Weight(self.packed[e], self.scales[e],
                          zeros=torch.full_like(self.scales[e], 8.0))

    def to(self, device: torch.device | str) -> Int4Experts:
        return Int4Experts(self.packed.to(device), self.scales.to(device))


Experts = Fp8Experts | Int4Experts


def stack(parts: list[Fp8Weight] | list[Int4Weight]) -> Experts:
    """One matrix per expert, in expert order, into the stacked form. INT4 experts must be
    symmetric (zero 8); FP8 experts share their scaling (block or per channel)."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1:
        raise ValueError("experts quantized in different formats")
    if kinds.pop() is Fp8Weight:
        blocks = {(p.block, p.w8a8) for p in parts}
        if len(blocks) != 1:
            raise ValueError("FP8 experts differ in scaling")
        block, w8a8 = blocks.pop()
        return Fp8Experts(torch.stack([p.data for p in parts]),
                          torch.stack([p.scales for p in parts]), block, w8a8)
    for p in parts:
        if p.zeros is None or not bool((p.zeros == 8).all()):
            raise ValueError("INT4 experts must be symmetric (zero point 8)")
    return Int4Experts(torch.stack([p.packed for p in parts]),
                       torch.stack([p.scales for p in parts]))


def quantize_experts(weight: torch.Tensor, scheme: str, w8a8: bool = False) -> Experts:
    """Round-to-nearest of stacked float experts [E, N, K]: int4 symmetric in groups of
    EXPERT_GROUP with bf16 scales (as Kimi K2 ships them), or fp8 in EXPERT_BLOCK ×
    EXPERT_BLOCK blocks (w8a8: activations rounded to FP8 too, Fp8Experts.w8a8)."""
    if scheme == "int4":
        return stack([quantize_rtn(w, EXPERT_GROUP, symmetric=True, scale_dtype=torch.bfloat16)
                      for w in weight])
    return stack([quantize_fp8(w, EXPERT_BLOCK, w8a8=w8a8) for w in weight])


def dequantize(w: torch.Tensor | Experts, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's matrix [N, K] in dtype, whatever its storage."""
    if isinstance(w, torch.Tensor):
        return w[e].to(dtype)
    return w.expert(e).dequantize(dtype)
